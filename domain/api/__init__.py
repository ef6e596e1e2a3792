"""The OpenAI-compatible API's bodies, for every door a request comes in by (an HTTP route, a batch line, a
conversation turn): the request models (pydantic, validated where they arrive) and the response pieces."""
