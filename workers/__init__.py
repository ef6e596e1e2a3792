"""The worker process, in three rooms:

    service/   NATS in and out: intake (pull what the engine can admit), the step loop, publishing deltas
    engine/    Engine.step(): schedule -> run the model -> update; sampling, detokenizing, prompt assembly
    executor/  the model on the device: the runner's forward over the paged KV cache, attention backends,
               linear layers and fused ops, and the C kernels behind them

``model_store`` acquires and loads model weights.
"""
