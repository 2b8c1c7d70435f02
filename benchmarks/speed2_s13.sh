# Issue 14, the next session's device calls (from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s13.sh gemv   # int8 GPU tests; exp74-full against exp74-full-s12
#                                        # (session 12's PDL sweep winners) and -preload
#   bash benchmarks/speed2_s13.sh ov     # GPU tests of the fused q/k norm + rotary; then
#                                        # ov-best-packed against its fused-q/k and
#                                        # max-autotune variants, five seeds, recipe baseline
# Each fits in 500 s, so it can run beside the en20 headline (benchmarks/two_gpus.sh).
set -o pipefail
case "$1" in
gemv)
    timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k int8 \
        2>&1 | tee "$OUT/gpu-tests-int8.log" | grep -E "passed|failed|FAILED|Error" | tail -4
    timeout 250 bash benchmarks/gpu_run.sh issue14-s13-gemv --baseline exp74-full \
        --stack benchmarks/stacks/exp74-full-s12.yaml \
        --stack benchmarks/stacks/exp74-full-preload.yaml --model rumik-oss-1 --device cuda \
        --workload gpu-headline --fidelity-steps 64 2>&1 | grep -v "^│" | tail -12
    rm -rf "$OUT/issue14-s13-gemv"
    timeout 130 python3 benchmarks/profile_step.py --frames 40 \
        --out "$OUT/issue14-s13-profile.json" \
        --stacks exp74-full benchmarks/stacks/exp74-full-s12.yaml 2>&1 | grep -v "^  " ;;
ov)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
        tests/test_omnivoice.py -k "qk_norm_rope" 2>&1 | tee "$OUT/gpu-tests-ov.log" \
        | grep -E "passed|failed|FAILED|Error" | tail -4
    timeout 360 bash benchmarks/gpu_run.sh issue14-s13-ov --baseline ov-recipe \
        --stack ov-best-packed --stack benchmarks/stacks/ov-best-packed-fused.yaml \
        --stack benchmarks/stacks/ov-best-packed-autotune.yaml --model omnivoice \
        --device cuda --workload ov-tput-seeds --fidelity-steps 0 2>&1 | grep -v "^│" | tail -10
    rm -rf "$OUT/issue14-s13-ov" ;;
*) echo "usage: speed2_s13.sh gemv|ov" >&2; exit 2 ;;
esac
