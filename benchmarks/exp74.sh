# The exp74 comparison for one device call (run from the repo root on the GPU host):
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh; bash benchmarks/exp74.sh
# GPU tests of the decode techniques first (fail fast), then stock vs baseline B vs the exact
# graph stack vs exp74 on the real shape, interleaved in one worker.
timeout 240 python3 -m pytest -q -x tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15
bash benchmarks/gpu_run.sh exp74 --stack baseline-b --stack exact-graph --stack exp74 \
    --model rumik-oss-1 --device cuda --workload gpu-quick --fidelity-steps 64
