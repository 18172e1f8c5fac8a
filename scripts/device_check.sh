#!/usr/bin/env bash
# One prepared GPU check (issue #36): a machine with an NVIDIA GPU and Python 3.12 with its
# own torch, triton, transformers, tokenizers, safetensors, click, pytest, hypothesis,
# xxhash, prometheus-client and tqdm, but not lmdb, zstandard nor kvikio.
#
# Here, before the run (wheels for Python 3.12 into .whl/, ignored by git):
#   echo /.whl/ >> .git/info/exclude
#   bash scripts/device_check.sh --fetch-wheels
# Rehearsal on a CPU-only machine (every step, small sizes, GPU-only parts skipped):
#   bash scripts/device_check.sh --rehearse
# On the GPU machine (carry .whl):
#   bash scripts/device_check.sh            # under 8 minutes; results under $OUT (or ./device-out)
#
# Steps, each under its own timeout so that one hanging step cannot take the others' time:
#   1. tests/gpu: CUDA device pool, page-locked host tier, kvikio reads (bf16 too, coalesced),
#      corrupt page as a miss, a client reading the daemon's pool through CUDA IPC;
#   2. tests/kernels compiled for the GPU (no interpreter);
#   3. scripts/bench_gpu_io.py: disk -> device pool (kvikio, compat mode, POSIX) against dd
#      iflag=direct; pinned host -> device against torch; CUDA IPC read against a D2D copy;
#   4. scripts/bench_ttft.py --llama8b: an 8B-shaped random model in bf16, 8k-token prefix:
#      recompute against restore from host and from disk (cold), logits compared;
#   5. scripts/bench_cascade.py on the shapes of docs/kernels.md (A, C, P256, N8 ran first).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="lmdb zstandard kvikio-cu13 libkvikio-cu13 rapids-logger==0.3.*"

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    for w in $WHEELS; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d .whl "$w" || echo "could not fetch $w" >&2
    done
    exit 0
fi
REHEARSE=0
[ "${1:-}" = "--rehearse" ] && REHEARSE=1

OUT="$(realpath -m "${OUT:-device-out}")"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TIERKV_PURE_PYTHON=1
if [ "$REHEARSE" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
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
# Homes and files of the benchmarks on the machine's disk, not a tmpfs /tmp.
export TMPDIR="${TMPDIR:-/var/tmp}/tierkv-check" && mkdir -p "$TMPDIR"
export TIERKV_BENCH_DIR="$TMPDIR"
cd /tmp/tkv

step() {  # step NAME SECONDS COMMAND...: its output to $OUT/NAME.log, its status and time to summary
    local name=$1 limit=$2; shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi  # STEPS="gpu_io ttft": only those
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "=== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    grep -h '^{' "$OUT/$name.log" | tail -n 1 >> "$OUT/summary.txt"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.is_available())"
    python3 -c "import kvikio, kvikio.defaults as d; print('kvikio', kvikio.__version__, 'compat', d.compat_mode() if hasattr(d, 'compat_mode') else '?')" 2>&1 | tail -n 1
    echo "cpus $(nproc); $(grep MemTotal /proc/meminfo)"
    df -hT "$TMPDIR" /tmp /dev/shm 2>&1
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

PYTEST="python3 -m pytest -q -p no:cacheprovider -o addopts= --timeout 120"
if [ "$REHEARSE" = 1 ]; then
    step tests_gpu 120 $PYTEST tests/gpu
    step gpu_io 120 python3 "$REPO/scripts/bench_gpu_io.py" --small --runs 1 --json
    step ttft 300 python3 "$REPO/scripts/bench_ttft.py" --small --runs 1 --page-codec none --gen-tokens 4 --json
    step cascade 120 python3 "$REPO/scripts/bench_cascade.py" --smoke --json
    step tests_kernels 200 $PYTEST tests/kernels
else
    step tests_gpu 60 $PYTEST tests/gpu
    step tests_kernels 80 $PYTEST tests/kernels
    step ttft 150 python3 "$REPO/scripts/bench_ttft.py" --llama8b --runs 2 --page-codec none --gen-tokens 16 --json
    step gpu_io 150 python3 "$REPO/scripts/bench_gpu_io.py" --gib 1 --runs 2 --json
    step cascade 50 python3 "$REPO/scripts/bench_cascade.py" --shapes A,B,N16,N32,N64,N128,P1024,P8192 --json
fi
rm -rf "$TMPDIR"
cat "$OUT/summary.txt"
