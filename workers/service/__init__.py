"""The worker service: NATS intake, the step loop around ``Engine.step()``, and publishing its outputs."""
