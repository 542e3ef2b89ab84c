"""Lifecycle events on the wire: Redis key names, the stream encoding, a batching writer and a
consumer-group reader. The policy's `Event` is the in-memory form; this package is its only
serialisation."""
