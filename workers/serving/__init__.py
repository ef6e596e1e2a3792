"""What every engine serves a request with, whichever runs the model: the boundary the worker calls
(``interface.ServingEngine``, with what an engine reports: ``stats``, ``kv_changes``), the prompt in (``prompts``:
chat template, history fitted, grammar and tool calls, message-prefix segments) and each choice's text out
(``choice``: detokenizer and stop strings, output filter, tool-call parser). Our engine (workers/engine/) and the
vLLM engine (workers/vllm_engine/) both build on it; neither imports the other."""
