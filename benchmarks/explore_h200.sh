# One autonomous exploration on the H200 within one device call (repo root, GPU host):
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh; bash benchmarks/explore_h200.sh [--from STACK] [--budget 5m] [--per-job N]
# Jobs run in one warm worker (the model is built once); `--fresh-worker` for one per job.
# Real shape, random weights, the gpu-explore workload (3 prompts x seed 42, 24 frames) under
# the manual gpu-explore protocol (EXPLORE_FAMILY=omnivoice: ov-explore's workload and
# protocol, e.g. EXPLORE_PROPOSERS="--proposer ladder --proposer params" ... --from ov-a). The database comes back whole ($OUT/explore.db: every
# candidate, run, decision and holdout audit); WAVs stay behind (too many files for one
# call), so a report made from that database elsewhere has no listening pack. The page made
# here ($OUT/explore-report.html, `orchestrate report`) embeds the clips of the runs this
# call made (a champion from an earlier call has its clips on that call's host only).
db=/tmp/explore.db
# EXPLORE_DB: a recorded exploration's database to go on with (`--resume ID --budget T`).
[ -n "$EXPLORE_DB" ] && cp "$EXPLORE_DB" "$db"
if [ "$1" = "--resume" ]; then
    args=("$@")
else
    # EXPLORE_PROPOSERS: the proposers, in turn order (default: profile first, then ladder).
    read -ra proposers <<< "${EXPLORE_PROPOSERS:---proposer profile --proposer ladder}"
    # EXPLORE_FAMILY=omnivoice: the OmniVoice model, ov-explore workload and protocol.
    if [ "${EXPLORE_FAMILY:-rumik}" = omnivoice ]; then
        target=(--model omnivoice --workload ov-explore --protocol configs/protocols/ov-explore.yaml)
    else
        target=(--model rumik-oss-1 --workload gpu-explore --protocol configs/protocols/gpu-explore.yaml)
    fi
    args=("${target[@]}" --device cuda "${proposers[@]}" "$@")
fi
timeout "${EXPLORE_TIMEOUT:-560}" python3 -m orchestrate.cli explore "${args[@]}" --no-mlflow \
    --db "sqlite:///$db" --runs-dir /tmp/explore-runs 2>&1 | tee "$OUT/explore.log"
python3 -m orchestrate.cli explorations --db "sqlite:///$db" 2>&1 | tee -a "$OUT/explore.log"
cp "$db" "$OUT/explore.db"
exploration=$2  # --resume ID; else the newest (this call's)
[ "$1" = "--resume" ] || exploration=$(python3 -m orchestrate.cli explorations \
    --db "sqlite:///$db" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)[0]["id"])')
python3 -m orchestrate.cli report "$exploration" --db "sqlite:///$db" \
    --out "$OUT/explore-report.html" 2>&1 | tail -1
tail -5 /tmp/explore-runs/*/worker.log > "$OUT/explore-workers.log" 2>/dev/null
# Each job's events (timestamped: where a job's minutes go), also of a job the timeout cut;
# one archive, as a device call returns at most 8 files.
(cd /tmp/explore-runs && tar czf "$OUT/events.tgz" ./*/events.jsonl)
