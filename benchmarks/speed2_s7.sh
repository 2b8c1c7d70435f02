# Issue 14, session 7 (two device calls; from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s7.sh check   # GPU tests, INT8 GEMV configs, per-kernel profiles
#   bash benchmarks/speed2_s7.sh ab      # baseline B, exp74-full-s6 and exp74-full in one
#                                        # worker; then exp74-full-s6 vs exp74-full alone
#   bash benchmarks/speed2_s7.sh final   # the rotary kernel in three programs: B, exp74-full
#                                        # and exp74-while in one worker
#   bash benchmarks/speed2_s7.sh while   # exp74-full and exp74-while, each with and without
#                                        # pdl, in one worker
# exp74-full-s6 -> exp74-full: the SwiGLU + pack kernel (fused_rope_norm's swiglu); both read
# the attention length as position + 1 on the device. A second call at e5775b7 profiled each
# of two changes alone (the other, decode attention's split merge inside its own launch, was
# slower and is gone): `check` with --stacks of those variants, in benchmarks/README.md.
set -o pipefail
case "$1" in
check)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
        tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -12
    timeout 120 python3 benchmarks/gemv_sweep.py --out "$OUT/gemv-sweep.json"
    timeout 220 python3 benchmarks/profile_step.py --frames 40 --out "$OUT/profile.json" \
        --stacks experiments/exp74-full-s6.yaml exp74-full 2>&1 | grep -v "^  " ;;
ab)
    timeout 330 bash benchmarks/gpu_run.sh issue14-s7-vs-b --baseline baseline-b \
        --stack experiments/exp74-full-s6.yaml --stack exp74-full \
        --model rumik-oss-1 --device cuda --workload gpu-headline --fidelity-steps 64
    timeout 230 bash benchmarks/gpu_run.sh issue14-s7-ab \
        --baseline experiments/exp74-full-s6.yaml --stack exp74-full \
        --model rumik-oss-1 --device cuda --workload gpu-headline --fidelity-steps 0 ;;
final)  # after the rotary kernel's three programs: tests, profile, B vs exp74-full vs -while
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
        tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -12
    timeout 100 python3 benchmarks/profile_step.py --frames 40 --out "$OUT/profile.json" \
        --stacks exp74-full 2>&1 | grep -v "^  "
    timeout 300 bash benchmarks/gpu_run.sh issue14-s7-final --baseline baseline-b \
        --stack exp74-full --stack exp74-while \
        --model rumik-oss-1 --device cuda --workload gpu-headline --fidelity-steps 64 ;;
while)  # why the WHILE graph is not faster: with and without PDL, per-token graph and WHILE
    timeout 400 bash benchmarks/gpu_run.sh issue14-s7-while --baseline exp74-full \
        --stack exp74-while --stack benchmarks/stacks/exp74-full-nopdl.yaml \
        --stack benchmarks/stacks/exp74-while-nopdl.yaml \
        --model rumik-oss-1 --device cuda --workload gpu-quick --fidelity-steps 0 ;;
*) echo "usage: speed2_s7.sh check|ab|final|while" >&2; exit 2 ;;
esac
