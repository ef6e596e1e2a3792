"""The vLLM engine in a process of its own, driven step by step from a test.

vLLM lives in its own environment (``.venv-vllm``), so the tests, which run in the project's, cannot import it.
This module is both ends of a pipe: run as a script under the vLLM environment's Python it builds a real
vLLM engine (``VllmEngine`` on SmolLM2, or the embeddings engine over vLLM on all-MiniLM-L6-v2, on the CPU)
as the worker builds it, and answers one JSON command per line on stdin, exactly the calls the worker
makes (prepare + add_request, step, abort_request, capacity, stats, take_kv_changes, kv_listing); imported by a
test, ``EngineProcess`` starts it and makes those calls. Messages are the wire's own structs (shared/messages.py),
as JSON.

    test ── {"op": "add", "request": GenerateRequest} ──▶ harness: engine.prepare, engine.add_request
         ◀─ {"prompt_tokens": n} | {"error": ErrorInfo} ──
         ── {"op": "step"} ─▶ engine.step() ─▶ {"deltas": [TokenDelta, ...]}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec

from switchyard.shared.kv_events import PrefixSegment
from switchyard.shared.messages import ErrorInfo, GenerateRequest, TokenDelta
from switchyard.workers.serving.kv_changes import KVChanges


class EngineProcess:
    """A harness child (stopped by PID in ``close``) and the calls a test makes of its engine."""

    def __init__(self, python: str, settings: dict, log_path, env: dict[str, str] | None = None) -> None:
        """``settings``: the ``WorkerConfig`` fields the engine is built with (model, max_num_seqs, ...); ``env``:
        variables its process gets besides this one's (vLLM reads some settings only from there)."""
        self._log = open(log_path, "ab")
        self._proc = subprocess.Popen([python, __file__, json.dumps(settings)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, start_new_session=True,
                                      env={**os.environ, **(env or {})})
        self.info = self._read()  # sent once the engine is built
        self.log_path = log_path

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM harness exited ({self._proc.wait()}); see {self._log.name}")
        return json.loads(line)

    def call(self, op: str, **args) -> dict:
        self._proc.stdin.write(msgspec.json.encode({"op": op, **args}) + b"\n")
        self._proc.stdin.flush()
        answer = self._read()
        if "crash" in answer:
            raise RuntimeError(answer["crash"])
        return answer

    def add(self, request: GenerateRequest) -> ErrorInfo | int:
        """prepare + add_request: the prompt's token count, or the refusal a client would get."""
        answer = self.call("add", request=request)
        if "error" in answer:
            return msgspec.convert(answer["error"], ErrorInfo)
        return answer["prompt_tokens"]

    def prepare(self, request: GenerateRequest) -> tuple[list[int], list[PrefixSegment]]:
        """``engine.prepare`` alone: the prompt's token ids as the engine gives them to vLLM, and its prefix
        segments."""
        answer = self.call("prepare", request=request)
        return answer["token_ids"], msgspec.convert(answer["prefix_segments"], list[PrefixSegment])

    def take_kv_changes(self) -> KVChanges | None:
        answer = self.call("kv_changes")["changes"]
        return None if answer is None else msgspec.convert(answer, KVChanges)

    def kv_listing(self) -> dict[str, list[int]]:
        return self.call("kv_listing")["listing"]

    def step(self) -> list[TokenDelta]:
        return msgspec.convert(self.call("step")["deltas"], list[TokenDelta])

    def run(self, max_steps: int = 5000) -> list[list[TokenDelta]]:
        """Steps until the engine has nothing left; each step's deltas."""
        steps = self.call("run", max_steps=max_steps)["steps"]
        return [msgspec.convert(step, list[TokenDelta]) for step in steps]

    def abort(self, request_id: str, error: ErrorInfo | None = None) -> bool:
        return self.call("abort", request_id=request_id, error=error)["ok"]

    def capacity(self) -> dict:
        return self.call("capacity")

    def stats(self) -> dict:
        return self.call("stats")

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.call("bye")
                self._proc.wait(timeout=30)
            except Exception:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


def _serve(settings: dict) -> None:
    # vLLM logs to stdout: the answers get a descriptor of their own, and stdout goes to the log.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    from switchyard.shared.config import SwitchyardConfig, WorkerConfig
    from switchyard.workers.service.engines import engine_builder

    # As a worker builds it: a chat model's VllmEngine, or an embedding model's EmbeddingEngine over vLLM.
    engine = engine_builder("vllm")(SwitchyardConfig(worker=WorkerConfig(**{"engine": "vllm", **settings})))

    def answer(value) -> None:
        answers.write(msgspec.json.encode(value) + b"\n")
        answers.flush()

    answer({"max_context": engine.max_context, "device_type": engine.device_type,
            "kv_block_size": engine.kv_block_size, "roles": list(engine.capabilities.roles)})
    added: list[str] = []  # request ids, for a reset
    for line in sys.stdin.buffer:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "add":
                request = msgspec.convert(command["request"], GenerateRequest, strict=False)
                try:
                    answer({"prompt_tokens": engine.add_request(request, engine.prepare(request))})
                    added.append(request.request_id)
                except Exception as exc:
                    if not hasattr(exc, "error"):
                        raise
                    answer({"error": exc.error})
            elif op == "prepare":
                prepared = engine.prepare(msgspec.convert(command["request"], GenerateRequest, strict=False))
                answer({"token_ids": prepared.token_ids, "prefix_segments": prepared.prefix_segments})
            elif op == "kv_changes":
                answer({"changes": engine.take_kv_changes()})
            elif op == "kv_listing":
                answer({"listing": engine.kv_listing()})
            elif op == "step":
                answer({"deltas": engine.step()})
            elif op == "run":
                steps = []
                while engine.has_unfinished_requests() and len(steps) < command["max_steps"]:
                    steps.append(engine.step())
                answer({"steps": steps})
            elif op == "abort":
                error = command.get("error")
                answer({"ok": engine.abort_request(command["request_id"],
                                                   None if error is None else msgspec.convert(error, ErrorInfo))})
            elif op == "capacity":
                answer(engine.capacity())
            elif op == "stats":
                answer(engine.stats())
            elif op == "reset":  # abort whatever is left and finish it
                for request_id in added:
                    engine.abort_request(request_id)
                added.clear()
                while engine.has_unfinished_requests():
                    engine.step()
                answer({})
            elif op == "bye":
                engine.shutdown()
                answer({})
                return
        except Exception as exc:  # the test hears of it, with the traceback in the log
            import traceback

            traceback.print_exc()
            answer({"crash": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
