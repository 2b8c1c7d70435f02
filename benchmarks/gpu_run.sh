# Run one orchestrate comparison on an offline GPU host and bring its evidence back:
#   bash benchmarks/gpu_run.sh NAME [orchestrate run options...]
# The job folder ($OUT/NAME/<job>/: job.json, events.jsonl, worker.log, result.json) is
# written under $OUT as the run goes, so a run stopped by a time limit still returns how
# far it got; $OUT/NAME.json is the run as stored. WAV folders sit one level too deep to
# come back. Needs `source benchmarks/device_setup.sh` first.
name=$1; shift
db=sqlite:////tmp/orchestrate-$name.db
python3 -m orchestrate.cli run "$@" --no-mlflow --db "$db" --runs-dir "$OUT/$name" \
    --json > "$OUT/$name.json"
rc=$?
id=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['id'])" "$OUT/$name.json" 2>/dev/null)
[ -n "$id" ] && python3 -m orchestrate.cli show "$id" --db "$db"
tail -3 "$OUT/$name"/*/worker.log 2>/dev/null
# A device call returns a limited number of files: with many stacks the per-utterance WAVs
# have crowded out result.json, so the evidence is copied up to $OUT and the
# WAVs (one level too deep to come back anyway) are dropped.
for f in result.json events.jsonl worker.log; do
    cp "$OUT/$name"/*/"$f" "$OUT/$name.${f%%.*}.${f##*.}" 2>/dev/null
done
find "$OUT/$name" -name '*.wav' -delete 2>/dev/null
echo "$name: exit $rc"
