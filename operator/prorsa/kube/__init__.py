"""Kubernetes adapters: pod discovery for the router (and, with the operator, the handlers)."""
