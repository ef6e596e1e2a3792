"""Durable consumers of JetStream that write to Postgres: the billing writer, the batch runner, housekeeping.

They run under ``switchyard jobs`` (a child of ``switchyard up``), or beside the HTTP app under ``switchyard
gateway`` unless ``--no-jobs``; they use the domain room (``switchyard.domain``), never the gateway.
"""
