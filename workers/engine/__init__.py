"""The engines: ours, ``Engine.step()`` = schedule -> run the model -> update, with no I/O (engine.py); and the
embeddings engine over a sentence-embedding model (embeddings.py). Both implement interface.py's ``ServingEngine``."""
