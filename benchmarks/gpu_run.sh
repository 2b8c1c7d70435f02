# Run one orchestrate comparison on an offline GPU host and keep what comes back small:
#   bash benchmarks/gpu_run.sh NAME [orchestrate run options...]
# Writes $OUT/NAME.json (the run as stored), $OUT/NAME-result.json (the worker's result
# record, for `orchestrate ingest`) and $OUT/NAME-worker.log. Needs device_setup.sh first.
name=$1; shift
db=sqlite:////tmp/orchestrate-$name.db
python3 -m orchestrator.cli run "$@" --no-mlflow --db "$db" --runs-dir "/tmp/runs-$name" \
    --json > "$OUT/$name.json"
rc=$?
cp /tmp/runs-"$name"/*/result.json "$OUT/$name-result.json" 2>/dev/null
cp /tmp/runs-"$name"/*/worker.log "$OUT/$name-worker.log" 2>/dev/null
id=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['id'])" "$OUT/$name.json" 2>/dev/null)
[ -n "$id" ] && python3 -m orchestrator.cli show "$id" --db "$db"
tail -3 "$OUT/$name-worker.log" 2>/dev/null
echo "$name: exit $rc"
