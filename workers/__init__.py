"""The worker process, in three rooms:

    service/   NATS in and out: intake, capacity (what may be pulled now), the step loop, publishing, liveness
    engine/    the engine interface the service needs (interface.py), and our engine: Engine.step(): schedule ->
               run the model -> update; sampling, detokenizing, prompt assembly
    executor/  the model on the device: the runner's forward over the paged KV cache, attention backends,
               linear layers and fused ops, and the C kernels behind them

``model_store`` acquires and loads model weights.
"""
