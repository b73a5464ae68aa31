"""The driver: continuous batching over any Engine, and the LLM API."""
