# Issue 14, session 7 (two device calls; from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s7.sh check   # GPU tests, INT8 GEMV configs, per-kernel profiles
#   bash benchmarks/speed2_s7.sh variants  # each change alone, GEMV configs swept again
#   bash benchmarks/speed2_s7.sh ab      # exp74-full-s6 (A) vs exp74-full (B), one worker
# What changed between A and B: the SwiGLU + pack kernel (fused_rope_norm swiglu) and the
# split merge inside decode attention's launch (fused_reduce); both read the length as
# position + 1 on the device.
set -o pipefail
case "$1" in
check)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
        tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -12
    timeout 120 python3 benchmarks/gemv_sweep.py --out "$OUT/gemv-sweep.json"
    timeout 220 python3 benchmarks/profile_step.py --frames 40 --out "$OUT/profile.json" \
        --stacks experiments/exp74-full-s6.yaml exp74-full 2>&1 | grep -v "^  " ;;
variants)  # after the first check: which of the two changes pays, with the new GEMV configs
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
        tests/test_gpu.py -k "fused_merge or profiler_agree or real_shapes or fused_rope" 2>&1 \
        | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -12
    timeout 150 python3 benchmarks/gemv_sweep.py --out "$OUT/gemv-sweep.json"
    v=benchmarks/stacks/issue14-s7
    timeout 300 python3 benchmarks/profile_step.py --frames 40 --out "$OUT/profile.json" \
        --stacks experiments/exp74-full-s6.yaml $v/exp74-full-swiglu-only.yaml \
        $v/exp74-full-merge-only.yaml exp74-full 2>&1 | grep -v "^  " ;;
ab)
    timeout 500 bash benchmarks/gpu_run.sh issue14-s7-ab \
        --baseline experiments/exp74-full-s6.yaml --stack exp74-full \
        --model rumik-oss-1 --device cuda --workload gpu-headline --fidelity-steps 64 ;;
*) echo "usage: speed2_s7.sh check|variants|ab" >&2; exit 2 ;;
esac
