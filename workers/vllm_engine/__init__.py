"""The vLLM engine: vLLM (V1) behind the worker's engine interface, beside our own (workers/engine/).

``engine.py`` (``VllmEngine``: the interface over vLLM's ``LLMEngine``), ``requests.py`` (a request as vLLM takes
it, and what it cannot honour), ``outputs.py`` (vLLM's token ids through our choice machinery into our deltas),
``load.py`` (capacity and stats), ``embedder.py`` (an embedding model on vLLM's pooling runner, the embedder of our
embeddings engine), ``args.py`` (the worker's settings as vLLM's ``EngineArgs``), ``environment.py`` (where vLLM is
installed, and the refusal when it is not). Only ``engine.py``, ``embedder.py`` and ``load.py`` import vLLM, and
only when an engine is built.
"""
