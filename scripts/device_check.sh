#!/usr/bin/env bash
# One prepared GPU check (a machine with an NVIDIA GPU; Python 3.12 with its own torch,
# triton, cupy and cuFile, but not kvikio nor tierkv's pure-Python dependencies).
#
# Here, before the run (wheels for Python 3.12 into .whl/, ignored by git):
#   echo /.whl/ >> .git/info/exclude
#   bash scripts/device_check.sh --fetch-wheels
# On the GPU machine (carry .whl):
#   bash scripts/device_check.sh            # under 8 minutes; results under $OUT (or ./device-out)
#
# It runs the GPU-marked tests (CUDA device pool, pinned host tier, kvikio reads into the
# device pool, compat-mode detection), the kernel tests on the GPU (no interpreter), then
# the store, TTFT and cascade benchmarks, each with --json, into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="lmdb xxhash zstandard click tqdm prometheus-client safetensors pytest pytest-timeout hypothesis kvikio-cu13 libkvikio-cu13"

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    for w in $WHEELS; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d .whl "$w" || echo "could not fetch $w" >&2
    done
    exit 0
fi

OUT="$(realpath -m "${OUT:-device-out}")"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site"
fi
# tierkv.kernels is the top-level kernels/ directory: lay the package out as installed, in
# /tmp/tkv, and run from there (from the repository root, its tierkv/ would shadow it).
REPO="$PWD"
rm -rf /tmp/tkv && mkdir -p /tmp/tkv
cp -r tierkv /tmp/tkv/tierkv && cp kernels/*.py /tmp/tkv/tierkv/kernels/ && cp -r tests /tmp/tkv/tests
cp pyproject.toml /tmp/tkv/
export PYTHONPATH="/tmp/tkv${PYTHONPATH:+:$PYTHONPATH}"
cd /tmp/tkv
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

timeout 180 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels 2>&1 | tee "$OUT/tests.log"
timeout 120 python3 "$REPO/scripts/bench_store.py" --gib 1 --runs 3 --json 2>&1 | tee "$OUT/bench_store.log"
timeout 120 python3 "$REPO/scripts/bench_cascade.py" --json 2>&1 | tee "$OUT/bench_cascade.log"
timeout 120 python3 "$REPO/scripts/bench_ttft.py" --device cuda --json 2>&1 | tee "$OUT/bench_ttft.log"
