#!/usr/bin/env bash
# Create .venv with the project, its dev tools and the offline quality scorers.
# torch and torchaudio first, as one consistent pair: 2.11.0 is the GPU image's version, and
# the newest torchaudio on PyPI does not load beside a newer CPU-only torch (the OmniVoice
# family imports it). On a CPU-only machine the CUDA build simply runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v flite >/dev/null 2>&1; then  # several test voices for speaker-similarity tests
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && apt-get install -y -qq flite >/dev/null) || echo "warning: flite not installed"
    else
        echo "warning: flite missing (apt-get install flite); speaker-similarity tests need it"
    fi
fi
# The CUDA build of torch 2.11 and its libraries take about 6.5 GB in .venv: say so up front
# rather than fail half-way through pip with "No space left on device".
if [ ! -x .venv/bin/torchrun ]; then
    read -r free_kb mount < <(df -Pk . | awk 'NR == 2 {print $4, $6}')
    if [ "$free_kb" -lt $((8 * 1024 * 1024)) ]; then
        echo "error: setup needs about 8 GB free for .venv (torch 2.11 with its CUDA libraries);" \
             "$((free_kb / 1024)) MB free on $mount" >&2
        exit 1
    fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# uv installs the same versions as pip (compared: `uv pip freeze` of both venvs) in about a
# third of the time: 75 s against 240 s for this list on a 2-core VM, most of pip's being
# unpacking and byte-compiling torch's CUDA wheels on one core. pip stays the fallback when
# uv cannot be had or fails (an index only pip's own configuration knows, say).
.venv/bin/python -m pip install -q --upgrade pip uv || echo "warning: uv not installed; using pip"
install() {
    if [ -x .venv/bin/uv ] && UV_NATIVE_TLS=1 .venv/bin/uv pip install -q --python .venv/bin/python "$@"; then
        return
    fi
    .venv/bin/python -m pip install -q "$@"
}
install "torch==2.11.0" "torchaudio==2.11.0"
install -e ".[orchestrator,dev,quality,omnivoice,postgres,ray]"
install --no-deps "omnivoice==0.2.1"
