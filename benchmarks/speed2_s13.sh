# Issue 14, session 13's device calls (from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s13.sh tests  # every GPU test (the int8 GEMV configs and the fused
#                                        # q/k norm + rotary are new since the last device run)
#   bash benchmarks/speed2_s13.sh gemv   # exp74-full against exp74-full-s12 (session 12's PDL
#                                        # sweep winners) and -preload; their profiles
#   bash benchmarks/speed2_s13.sh ov     # ov-best-packed against its fused-q/k and
#                                        # max-autotune variants, five seeds, recipe baseline
# Each fits in 500 s, so it can run beside the en20 headline (benchmarks/two_gpus.sh), and
# `tests` + `gemv` fit one call.
set -o pipefail
case "$1" in
tests)
    timeout 190 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 \
        | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8 ;;
gemv)
    timeout 240 bash benchmarks/gpu_run.sh issue14-s13-gemv --baseline exp74-full \
        --stack benchmarks/stacks/exp74-full-s12.yaml \
        --stack benchmarks/stacks/exp74-full-preload.yaml --model rumik-oss-1 --device cuda \
        --workload gpu-headline --fidelity-steps 64 2>&1 | grep -v "^│" | tail -12
    rm -rf "$OUT/issue14-s13-gemv"
    timeout 110 python3 benchmarks/profile_step.py --frames 40 \
        --out "$OUT/issue14-s13-profile.json" \
        --stacks exp74-full benchmarks/stacks/exp74-full-s12.yaml 2>&1 | grep -v "^  " ;;
ov)
    timeout 360 bash benchmarks/gpu_run.sh issue14-s13-ov --baseline ov-recipe \
        --stack ov-best-packed --stack benchmarks/stacks/ov-best-packed-fused.yaml \
        --stack benchmarks/stacks/ov-best-packed-autotune.yaml --model omnivoice \
        --device cuda --workload ov-tput-seeds --fidelity-steps 0 2>&1 | grep -v "^│" | tail -10
    rm -rf "$OUT/issue14-s13-ov" ;;
*) echo "usage: speed2_s13.sh tests|gemv|ov" >&2; exit 2 ;;
esac
