# The exp74 headline for one device call (run from the repo root on the GPU host):
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh; bash benchmarks/exp74.sh
# GPU tests of the newest decode techniques first (bounded), then stock (A) vs baseline B vs
# the exact graph stack vs exp74 vs exp74-full (+ fused rope/norm + PDL) at real shape,
# interleaved in one worker. A stack that fails is recorded as failed; the others still run.
timeout 80 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider \
    -k "fused or int6 or pdl or launches or graph_kernel" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -12
timeout 460 bash benchmarks/gpu_run.sh exp74 --stack baseline-b --stack exact-graph --stack exp74 \
    --stack exp74-full --model rumik-oss-1 --device cuda --workload gpu-headline --fidelity-steps 64
