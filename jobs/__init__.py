"""Durable consumers of JetStream that write to Postgres: the billing writer, the batch runner, housekeeping.

They run inside the gateway process by default and alone under ``switchyard jobs``.
"""
