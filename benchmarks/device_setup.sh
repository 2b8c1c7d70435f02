# Prepare a bare, offline GPU host for this project. Source it from the repo root (export
# ORCHESTRATE_CODE_SHA=$(git rev-parse HEAD) first: the copied tree has no .git to read):
#   source benchmarks/device_setup.sh
# Carried wheels (.whl/: pydantic, sqlalchemy, alembic, mako) go to /tmp/site; the project
# itself is installed editable so its entry points (technique plugins) register.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING || true
python3 -c "import orchestrator.registry as r; print('techniques:', sorted(r.discover()))"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv,noheader
