"""Running Prorsa on one machine: the worker registry in Redis (the local stand-in for pod
labels and annotations), the tiny model, and the runner."""
