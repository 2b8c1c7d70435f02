#!/usr/bin/env bash
# Create .venv with the project, its dev tools and the offline quality scorers.
# CPU torch first: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v flite >/dev/null 2>&1; then  # several test voices for speaker-similarity tests
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && apt-get install -y -qq flite >/dev/null) || echo "warning: flite not installed"
    else
        echo "warning: flite missing (apt-get install flite); speaker-similarity tests need it"
    fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,quality]"
