# Rumik re-measured after the architecture move (issue 10): stock and exp74-full at real shape on
# the committed record's workload (h200/issue3-headline-while-int6.result.json: stock RTF
# 2.7824, exp74-full 0.1687), interleaved in one worker; then exp74-full alone in a fresh
# worker, whose peak GPU memory is then that stack's own (issue 14's memory question).
# Run from the repo root on the GPU host after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
timeout 400 bash benchmarks/gpu_run.sh rumik-remeasure --stack exp74-full \
    --model rumik-oss-1 --device cuda --workload gpu-headline --fidelity-steps 64
timeout 150 bash benchmarks/gpu_run.sh exp74-full-alone --baseline exp74-full \
    --stack exp74-full --model rumik-oss-1 --device cuda --workload gpu-headline \
    --fidelity-steps 0
