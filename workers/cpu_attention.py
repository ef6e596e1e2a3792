"""CPU decode attention read straight from the paged KV cache, by a small C kernel compiled at first use.

On CPU the SDPA backend spends most of a decode step's attention time copying: every layer gathers each sequence's
KV blocks into a padded buffer (``index_select``), then SDPA reads the copy again. For 32 sequences of 50-528
tokens (SmolLM2, fp32, 2 threads) that was 91 ms of a 277 ms step. ``csrc/paged_decode.c`` reads each K/V row once,
in place, through the block table, for all query heads that share it.

There is no CPU paged-attention kernel on PyPI for this torch (IPEX, the one that had one, tracks older torch
releases), and a torch C++ extension costs a minute of compiling; a plain C file builds in about a second with the
gcc the machine has, and is called through ctypes (which releases the GIL, so the worker's event loop keeps going).

    <cache>/paged_decode-<hash of source, flags and CPU>.so     built once per machine, renamed into place

Nothing here is required: when there is no compiler, the build fails or the dtype is not fp32, ``make_attention``
keeps the SDPA backend (and says why in the log).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
import torch

from workers.attention import SdpaAttention, StepMetadata

log = logging.getLogger("switchyard.cpu_attention")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11")


def _cache_dir() -> Path:
    """``SWITCHYARD_KERNEL_CACHE``, else the user's cache directory."""
    explicit = os.environ.get("SWITCHYARD_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "switchyard" / "kernels"


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, building it if needed; None (logged once) where it cannot be had."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention uses SDPA (slower)")
        return None
    source = SOURCE.read_bytes()
    # -march=native: the library is only valid for this CPU, so the CPU's flags are part of its name.
    key = hashlib.sha256(source + " ".join(CFLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                subprocess.run([compiler, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(tmp, target)  # atomic: concurrent builders each install a whole file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building %s failed, CPU decode attention uses SDPA (slower): %s", SOURCE.name, detail)
            return None
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_f32
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = i32
    return lib


class CpuPagedAttention(SdpaAttention):
    """SDPA for prefill chunks, the C kernel for decodes (fp32 caches on CPU)."""

    name = "cpu_paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, device)
        lib = load_kernel()
        if lib is None:
            raise RuntimeError(f"the CPU decode kernel ({SOURCE.name}) could not be built")
        self._kernel = lib.paged_decode_f32

    def _prepare_decodes(self, meta: StepMetadata, table: torch.Tensor, num_blocks: list[int]) -> None:
        # The kernel walks each table only up to the sequence's own length: no masks, no padding work, no groups.
        meta.decode_blocks = table[:, : max(num_blocks)].contiguous()
        meta.decode_context_lens = (meta.positions[meta.num_prefill_tokens :] + 1).contiguous()

    def _attend_decodes(self, q_dec, k_cache, v_cache, meta: StepMetadata) -> torch.Tensor:
        if q_dec.stride(2) != 1 or q_dec.stride(1) != self.head_dim:
            q_dec = q_dec.contiguous()
        batch = q_dec.shape[0]
        out = q_dec.new_empty(batch, self.num_heads * self.head_dim)
        status = self._kernel(
            q_dec.data_ptr(), q_dec.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            meta.decode_blocks.data_ptr(), meta.decode_blocks.stride(0), meta.decode_context_lens.data_ptr(),
            out.data_ptr(), batch, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, self.scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"paged_decode_f32 failed with status {status}")
        return out
