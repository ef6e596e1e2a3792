"""The engine: ``Engine.step()`` is schedule -> run the model -> update, with no I/O."""
