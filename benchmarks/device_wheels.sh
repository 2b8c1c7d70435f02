#!/usr/bin/env bash
# Fill .whl/ (gitignored) with the Python 3.12 x86-64 wheels that the GPU host's image lacks,
# at the versions of this checkout's .venv, so that `source benchmarks/device_setup.sh` there
# installs the project offline. Run here, in the repo root, after scripts/setup.sh:
#   bash benchmarks/device_wheels.sh            # the project, OmniVoice, Optuna: about 30 MB
#   bash benchmarks/device_wheels.sh flashinfer # also FlashInfer 0.6.18.post1 and its needs
# The image already holds torch, triton, transformers, numpy, jinja2, pyyaml, tqdm and
# accelerate (KINDS.md's package list); mlflow is not carried (the device scripts read the
# store, not the tracking server).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "error: no .venv here: run scripts/setup.sh first" >&2; exit 1; }
PROJECT=(pydantic pydantic_core annotated_types typing_inspection typing_extensions sqlalchemy
         greenlet alembic mako typer click shellingham rich markdown_it_py mdurl pygments
         jiwer rapidfuzz confusables soundfile cffi pycparser pydub omnivoice optuna colorlog)
# flashinfer 0.7's wheel (101 MB) is over the 64 MiB a device call carries.
FLASHINFER=(flashinfer-python==0.6.18.post1 apache-tvm-ffi einops tabulate nvidia-ml-py
            nvidia-cudnn-frontend cuda-tile nccl4py)
pins=()
freeze=$(.venv/bin/python -m pip freeze 2>/dev/null | tr 'A-Z-' 'a-z_')
for name in "${PROJECT[@]}"; do
    pin=$(grep -E "^${name}==" <<<"$freeze" || true)
    # Not in .venv: nothing the project installs needs it (greenlet, on some platforms).
    [ -n "$pin" ] && pins+=("$pin")
done
[ "${1:-}" = flashinfer ] && pins+=("${FLASHINFER[@]}")
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
plat=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    plat+=(--platform "${p}_x86_64")
done
# One pip call per wheel: --no-deps with a mixed pure/binary list fails as a whole on one miss.
for pin in "${pins[@]}"; do
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" --platform any -d .whl "$pin" \
        || { echo "error: no py3.12 x86-64 wheel for $pin" >&2; exit 1; }
done
du -sh .whl
