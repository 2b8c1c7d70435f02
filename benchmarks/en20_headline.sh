# Issue 14's full-workload headline: en20 (20 prompts x 3 seeds, 3 warm-ups) for stock, baseline
# B and exp74-full, interleaved in one worker. Stock alone takes about 15 minutes of H200 time and
# one device call at most 10, so the run is cut into calls and resumed (`orchestrate run
# --resume`: the utterances measured so far are kept, warm-ups redone; it refuses other code or
# another device). From the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
# call 1:      bash benchmarks/en20_headline.sh
# each next:   carry `.en20` holding the last call's en20-state.tgz (copied from its $OUT), same
#              commit, then the same command. It says RESUMABLE until the run is FINISHED.
# State lives in /tmp/en20 (the database and the job folders; absolute paths, as the database
# records them) and travels as one file. EN20_* variables change model, workload, stacks and
# the per-call budget (for a CPU rehearsal of the mechanics with the tiny model).
set -o pipefail
STATE=/tmp/en20
DB=sqlite:///$STATE/orchestrate.db
BUDGET=${EN20_BUDGET_S:-540}
MODEL=${EN20_MODEL:-rumik-oss-1}
DEVICE=${EN20_DEVICE:-cuda}
WORKLOAD=${EN20_WORKLOAD:-en20}
STACKS=${EN20_STACKS:-"--baseline stock --stack baseline-b --stack exp74-full"}
CARRIED=${EN20_CARRIED:-.en20/en20-state.tgz}
mkdir -p "$STATE"
[ -f "$CARRIED" ] && tar xzf "$CARRIED" -C /tmp
# the newest run, if it can be resumed
last=$(python3 -m orchestrate.cli runs --db "$DB" --json --limit 1 2>/dev/null | python3 -c "
import json, sys
runs = json.load(sys.stdin)  # newest first
print(runs[0]['id'] if runs and runs[0]['status'] in ('INTERRUPTED', 'FAILED') else '')
" 2>/dev/null)
if [ -n "$last" ]; then
    echo "resuming run $last"
    timeout -s TERM "$BUDGET" python3 -m orchestrate.cli run --resume "$last" --no-mlflow \
        --db "$DB" --json > "$OUT/en20.json"
else
    # shellcheck disable=SC2086  # STACKS is a list of options
    timeout -s TERM "$BUDGET" python3 -m orchestrate.cli run $STACKS --model "$MODEL" \
        --device "$DEVICE" --workload "$WORKLOAD" --fidelity-steps 0 --no-mlflow --db "$DB" \
        --runs-dir "$STATE/runs" --json > "$OUT/en20.json"
fi
rc=$?
find "$STATE" -name '*.wav' -delete  # the state must travel in one small file
tar czf "$OUT/en20-state.tgz" -C /tmp en20
newest=$(python3 -m orchestrate.cli runs --db "$DB" --json --limit 1 | python3 -c "
import json, sys
runs = json.load(sys.stdin)
print(runs[0]['id'], runs[0]['status'])")
echo "run $newest (exit $rc)"
case "$newest" in
*FINISHED*|*PARTIAL*)
    id=${newest%% *}
    python3 -m orchestrate.cli show "$id" --db "$DB"
    ls -t "$STATE"/runs/*/result.json | head -1 | xargs -I{} cp {} "$OUT/en20.result.json" ;;
*) echo "RESUMABLE: carry .en20/en20-state.tgz from this call's \$OUT into the next" ;;
esac
