"""ninfer-serve: the OpenAI-compatible HTTP server (see docs/SERVING.md)."""
