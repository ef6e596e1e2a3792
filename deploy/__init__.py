"""Running Switchyard on one machine: ``switchyard up``, the embedded NATS and Postgres servers, and the child
processes it starts and stops by PID."""
