# exp74-full's prefix ladder with three seeds (gpu-ladder-seeds: a CI on every ratio),
# for one device call (from the repo root on the GPU host):
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
#   bash benchmarks/exp74_ladder_seeds.sh
# Stock, then every cumulative prefix of exp74-full, interleaved in one worker. A run cut by
# the time limit keeps what it measured (gpu_run.sh copies the job folder up to $OUT).
timeout "${RUN_S:-540}" bash benchmarks/gpu_run.sh issue14-ladder-seeds --stack exp74-full \
    --prefixes --model rumik-oss-1 --device cuda --workload gpu-ladder-seeds \
    --fidelity-steps 0 2>&1 | grep -v "^│" | tail -14
[ -f "$OUT/issue14-ladder-seeds.result.json" ] && rm -rf "$OUT/issue14-ladder-seeds"
