# A report page from a real GPU run (`orchestrate report RUN`): exp74-full against stock on
# gpu-listen (gpu-pool's two prompts, every clip kept), the page written on the GPU host,
# where the run's WAVs are, so its listening pack plays them. From the repo root there:
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
#   bash benchmarks/report_page_gpu.sh     (about 2 minutes; writes $OUT/run-report.html,
#                                           its headline figure, the run's JSON and database)
set -o pipefail
db=sqlite:////tmp/page.db
rm -f /tmp/page.db
timeout 300 python3 -m orchestrate.cli run --stack exp74-full --model rumik-oss-1 --device cuda \
    --workload gpu-listen --db "$db" --runs-dir /tmp/page-runs --no-mlflow --json \
    > "$OUT/page-run.json" 2> "$OUT/page-run.log" || { tail -5 "$OUT/page-run.log"; exit 1; }
run=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["id"])' "$OUT/page-run.json")
python3 -m orchestrate.cli show "$run" --db "$db" | tee "$OUT/page-run.show.txt"
python3 -m orchestrate.cli report "$run" --db "$db" --out "$OUT/run-report.html" --figures "$OUT"
cp /tmp/page.db "$OUT/page.db"
