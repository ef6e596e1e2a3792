"""The worker service: the I/O shell around an engine (intake, capacity, the step loop, publishing, liveness; see
``worker.py``), which reaches the engine only through ``workers/serving/interface.py``."""
