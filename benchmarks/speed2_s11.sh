# Issue 14, session 11 (from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s11.sh ab        # GPU tests of the kernels and techniques; then
#                                           # exp74-full, exp74-fused and exp74-fused without
#                                           # the weight preload in one worker (gpu-headline)
#   bash benchmarks/speed2_s11.sh profile   # the corrected GPU test; kernels and GPU time per
#                                           # token of exp74-full and exp74-fused, with and
#                                           # without pdl; then benchmarks/speed2_ov.sh
# exp74-full -> exp74-fused: fused_rope_norm's into_gemv (the rotary + cache write in the
# input GEMV's epilogue, the SwiGLU in the output GEMV's load: 2 launches a layer fewer) and
# the GEMVs' first weight chunk loaded before the PDL wait.
#   bash benchmarks/speed2_s11.sh ab2       # after the profile: the SwiGLU moved into the
#                                           # input GEMV's epilogue; GPU tests, A/B, profile
#   bash benchmarks/speed2_s11.sh ab3       # its epilogue loads hoisted; then ov-recipe,
#                                           # ov-best, ov-best-packed on five seeds
#   bash benchmarks/speed2_s11.sh sweep     # (next session) INT8 GEMV configs with preload
#                                           # and reduce_each, without and with PDL; then
#                                           # exp74-full against exp74-full-preload
set -o pipefail
case "$1" in
ab)
    timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
        tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -12
    timeout 360 bash benchmarks/gpu_run.sh issue14-s11-fused --baseline exp74-full \
        --stack exp74-fused --stack benchmarks/stacks/exp74-fused-nopreload.yaml \
        --model rumik-oss-1 --device cuda --workload gpu-headline --fidelity-steps 64 \
        2>&1 | grep -v "^│" | tail -24
    rm -rf "$OUT/issue14-s11-fused" ;;
profile)
    timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k into_gemv \
        2>&1 | grep -E "passed|failed|FAILED|Error" | tail -4
    timeout 260 python3 benchmarks/profile_step.py --frames 40 --out "$OUT/issue14-s11-profile.json" \
        --stacks exp74-full exp74-fused benchmarks/stacks/exp74-full-nopdl.yaml \
        benchmarks/stacks/exp74-fused-nopdl.yaml 2>&1 | grep -v "^  "
    bash benchmarks/speed2_ov.sh ;;
ab2)  # the second version: SwiGLU in the input GEMV's epilogue, the output GEMV reading two rows
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
        tests/test_gpu.py -k "fused or into_gemv" 2>&1 | tee "$OUT/gpu-tests.log" \
        | grep -E "passed|failed|FAILED|Error" | tail -8
    timeout 280 bash benchmarks/gpu_run.sh issue14-s11-fused2 --baseline exp74-full \
        --stack exp74-fused --model rumik-oss-1 --device cuda --workload gpu-headline \
        --fidelity-steps 64 2>&1 | grep -v "^│" | tail -16
    rm -rf "$OUT/issue14-s11-fused2"
    timeout 150 python3 benchmarks/profile_step.py --frames 40 \
        --out "$OUT/issue14-s11-profile2.json" --stacks exp74-full exp74-fused 2>&1 | grep -v "^  " ;;
ab3)  # the epilogue's position and table loads hoisted above the K loop; OmniVoice again
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
        -k "fused" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -4
    timeout 150 bash benchmarks/gpu_run.sh issue14-s11-fused3 --baseline exp74-full \
        --stack exp74-fused --model rumik-oss-1 --device cuda --workload gpu-headline \
        --fidelity-steps 0 2>&1 | grep -v "^│" | tail -6
    rm -rf "$OUT/issue14-s11-fused3"
    timeout 200 bash benchmarks/gpu_run.sh issue14-s11-ov-packed --baseline ov-recipe \
        --stack ov-best --stack ov-best-packed --model omnivoice --device cuda \
        --workload ov-tput-seeds --fidelity-steps 0 2>&1 | grep -v "^│" | tail -6
    rm -rf "$OUT/issue14-s11-ov-packed" ;;
sweep)  # written after this session's device time: the INT8 GEMV's preload / reduce_each
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
        -k "int8" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -4
    timeout 150 python3 benchmarks/gemv_sweep.py --out "$OUT/gemv-sweep.json"
    timeout 150 python3 benchmarks/gemv_sweep.py --pdl --out "$OUT/gemv-sweep-pdl.json"
    timeout 200 bash benchmarks/gpu_run.sh issue14-preload --baseline exp74-full \
        --stack benchmarks/stacks/exp74-full-preload.yaml --model rumik-oss-1 --device cuda \
        --workload gpu-headline --fidelity-steps 0 2>&1 | grep -v "^│" | tail -6
    rm -rf "$OUT/issue14-preload" ;;
*) echo "usage: speed2_s11.sh ab|profile|ab2|ab3|sweep" >&2; exit 2 ;;
esac
