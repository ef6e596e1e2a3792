"""The HTTP edge: OpenAI-compatible routes per resource over named services, publishing to NATS and relaying SSE;
authentication, admission and storage are the domain room's (``switchyard.domain``)."""
