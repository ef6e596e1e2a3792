"""The domain room, below the HTTP edge (``gateway``) and the durable consumers (``jobs``), which both use it:
Postgres with its circuit breaker, authentication and tenancy, admission (tiers, routing, limits, budget, safety:
``domain/admission/``), the model registry, publishing requests, the API's bodies and the stored formats
(conversations, files, batches). It imports nothing from ``gateway`` or ``jobs``."""
