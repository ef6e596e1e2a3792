"""The HTTP edge: OpenAI-compatible routes, authentication, limits, publishing to NATS and relaying SSE."""
