"""Switchyard: self-hosted LLM serving behind an OpenAI-compatible API.

One import name, mapped by ``pyproject.toml`` from the repository's top-level folders::

    switchyard            the root: the ``switchyard`` command (``switchyard.cli``)
    switchyard.gateway    gateway/     HTTP edge: routes, serving, SSE relay
    switchyard.domain     domain/      what gateway and jobs share: database, auth, admission, publishing, stores
    switchyard.jobs       jobs/        durable consumers: billing writer, batch runner, housekeeping
    switchyard.workers    workers/     the worker process: service (NATS), engine, executor (model, kernels)
    switchyard.scheduler  scheduler/   pure-Python scheduling and KV block accounting
    switchyard.shared     shared/      wire messages, subjects, settings, tiers
    switchyard.migrations migrations/  SQL
    switchyard.deploy     deploy/      the local launcher (embedded NATS and Postgres, ``switchyard up``)
"""

__version__ = "0.1.0"
