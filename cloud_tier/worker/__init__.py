"""A single engine instance behind an OpenAI-compatible API (``cascade cloud worker``)."""
