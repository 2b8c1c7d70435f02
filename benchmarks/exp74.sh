# The exp74 headline for one device call (run from the repo root on the GPU host):
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh; bash benchmarks/exp74.sh
# GPU tests of the newest decode techniques first (bounded), then stock (A) vs baseline B vs
# the exact graph stack vs exp74 and its variants (+ fused glue and PDL; the WHILE-graph
# loop; INT6; the inductor-compiled step) at real shape, interleaved in one worker. A stack
# that fails is recorded as failed; the others still run. Without a working exp74-compiled
# this took ~470 s on an H200; with its compile it may need the full 600 s of a call.
timeout 80 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider \
    -k "fused or int6 or pdl or launches or graph_kernel or while_graph" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -12
timeout 500 bash benchmarks/gpu_run.sh exp74 --stack baseline-b --stack exact-graph --stack exp74 \
    --stack exp74-full --stack exp74-while --stack exp74-int6 --stack exp74-compiled \
    --model rumik-oss-1 --device cuda --workload gpu-headline --fidelity-steps 64
