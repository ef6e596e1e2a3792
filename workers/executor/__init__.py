"""The model executor: turns a step's chunks into tensors and runs the model over the paged KV cache."""
