# Issue 14, session 18's device calls (from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s18.sh        # 1. the TMA GEMV's GPU tests, then its sweep against
#                                        #    the shipped and s12 configs (PDL, three passes);
#                                        # 2. OmniVoice's FP8-GEMM and attention probe
#   bash benchmarks/speed2_s18.sh ab     # exp74-full against exp74-full-tma in one worker,
#                                        # then both profiled
set -o pipefail
if [ "$1" = ab ]; then
    timeout "${RUN_S:-330}" bash benchmarks/gpu_run.sh issue14-s18-tma --baseline exp74-full \
        --stack=benchmarks/stacks/exp74-full-tma.yaml --model rumik-oss-1 --device cuda \
        --workload gpu-headline --fidelity-steps 64 2>&1 | tail -30
    timeout "${PROFILE_S:-150}" python3 benchmarks/profile_step.py --model rumik-oss-1 \
        --stacks exp74-full benchmarks/stacks/exp74-full-tma.yaml --frames 40 --top 12 \
        --out "$OUT/issue14-s18-tma-profile.json" 2>&1 | grep -v "Warning\|warn" | tail -30
    exit
fi
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    "tests/test_kernels.py::test_gpu_tma_gemv_real_shapes_in_graph_with_pdl" \
    "tests/test_kernels.py::test_gpu_real_shapes_graphs_and_pdl" 2>&1 \
    | tee "$OUT/issue14-s18-gpu-tests-tma.log" | grep -E "passed|failed|FAILED|Error" | tail -6
timeout "${SWEEP_S:-200}" python3 benchmarks/gemv_sweep.py --tma --pdl --repeats 3 \
    --out "$OUT/issue14-s18-gemv-sweep-tma.json" 2>&1 | grep -v "Warning\|warn" | tail -16
timeout "${PROBE_S:-150}" python3 benchmarks/ov_probe_fp8_attn.py \
    --out "$OUT/issue14-s18-ov-probe.json" 2>&1 | grep -v "Warning\|warn" | tail -20
