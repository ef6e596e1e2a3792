"""Running Switchyard: the local launcher (``switchyard up``, embedded NATS and Postgres, child processes).

Images, Compose and Kubernetes files live beside this package in ``deploy/``.
"""
