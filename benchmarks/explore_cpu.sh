#!/usr/bin/env bash
# The two CPU explorations issue 13 asks for, as committed records (repo root, after
# scripts/setup.sh; about 9 minutes on a 2-core machine):
#   bash benchmarks/explore_cpu.sh [OUT_DIR]        (default benchmarks/cpu)
# 1. tiny Rumik model (random weights) from stock, ladder proposer, target 1.3x: the workload,
#    holdout and manual protocol of tests/test_explore.py's speed test (192 frames a clip).
# 2. the Piper family (real weights) from piper-stock, ladder proposer: the workload, holdout
#    and quality gates of tests/test_explore_piper.py (WER, MOS, SIM bounds).
# Each writes NAME.json (`orchestrate explorations ID --json --records`: every candidate with
# its decision and numbers, every run's result record with GPU/CPU, versions, git SHA),
# NAME.log (the exploration's own lines) and the report's figures under OUT_DIR/figures/.
set -euo pipefail
out=${1:-benchmarks/cpu}
mkdir -p "$out/figures"
py=.venv/bin/python
work=$(mktemp -d)
$py - "$work" <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, "tests")
import test_explore as t
import test_explore_piper as p

root = Path(sys.argv[1])
(root / "tiny").mkdir()
(root / "piper").mkdir()
t.files(root / "tiny", frames=192, seeds="[42, 43]", warmups=1)
for name, text in (("wl", p.WORKLOAD), ("holdout", p.HOLDOUT), ("protocol", p.PROTOCOL)):
    (root / "piper" / f"{name}.yaml").write_text(text)
PY
explore() {  # NAME DIR explore-args...
    local name=$1 dir=$2; shift 2
    local db="sqlite:///$dir/o.db"
    (cd "$dir" && "$OLDPWD/$py" -m orchestrate.cli explore --workload wl.yaml \
        --protocol protocol.yaml --holdout holdout.yaml --no-mlflow --db "$db" "$@" \
        2> >(tee "$OLDPWD/$out/$name.log" >&2))
    local id
    id=$($py -m orchestrate.cli explorations --db "$db" --json | $py -c \
        "import json, sys; print(json.load(sys.stdin)[0]['id'])")
    $py -m orchestrate.cli explorations "$id" --db "$db" --json --records > "$out/$name.json"
    $py -m orchestrate.cli report "$id" --db "$db" --out "$dir/page.html" --figures "$out/figures"
}
explore issue13-explore-tiny "$work/tiny" --budget "9m, 8 jobs" --target 1.3 --proposer ladder
explore issue13-explore-piper "$work/piper" --model piper-joe --budget "12m, 8 jobs" \
    --proposer ladder
