"""Our engines: ``Engine.step()`` = schedule -> run the model -> update, with no I/O (engine.py); and the
embeddings engine over a sentence-embedding model (embeddings.py). Both implement ``ServingEngine``
(workers/serving/interface.py) and build on what every engine shares there."""
