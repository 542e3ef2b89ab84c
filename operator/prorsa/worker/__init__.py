"""The worker agent: runs one vLLM engine in a role and keeps it healthy."""
