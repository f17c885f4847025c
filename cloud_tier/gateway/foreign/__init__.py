"""Foreign (OpenAI-compatible) workers: the proxy, their answers' shape, routing on their load."""
