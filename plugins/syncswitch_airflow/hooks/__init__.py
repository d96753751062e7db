"""Hooks: the pipeline's clients of external services (each owns its client and its waits)."""
