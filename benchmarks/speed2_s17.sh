# Issue 14, session 17's device call (from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s17.sh
# 1. why test_qk_norm_rope_op_inside_torch_compile failed in this session's first GPU-test
#    run (benchmarks/qk_compile_diag.py), then the test as it now stands;
# 2. ov_gemm_sweep.py with warps/stages varied and cuBLASLt beside cuBLAS (the first sweep
#    of this session: no small_gemm config within 1.4x of cuBLAS at 4 warps, 4 stages);
# 3. the fused q/k/v kernel's num_warps (benchmarks/ov_qkv_warps.py).
#   bash benchmarks/speed2_s17.sh fix  # after the eps fix: the compile test, the warps, then
#                                      # the whole GPU suite (carry optuna: its tests collect)
set -o pipefail
compile_test() {  # compile_test LOG: the q/k/v kernel's torch.compile GPU test
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
        "tests/test_kernels.py::test_qk_norm_rope_op_inside_torch_compile" 2>&1 \
        | tee "$OUT/$1" | grep -E "passed|failed|FAILED|Error" | tail -4
}
warps() {
    timeout 60 python3 benchmarks/ov_qkv_warps.py --out "$OUT/issue14-s17-ov-qkv-warps.json" \
        2>&1 | grep -v "Warning\|warn"
}
if [ "$1" = fix ]; then
    compile_test gpu-tests-qk-compile-fixed.log
    warps
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -rfE \
        --continue-on-collection-errors 2>&1 | tee "$OUT/issue14-s17-gpu-tests-fixed.log" \
        | grep -E "passed|failed|FAILED|ERROR" | tail -12
    exit
fi
timeout 120 python3 benchmarks/qk_compile_diag.py 2>&1 | tee "$OUT/qk-compile-diag.log" \
    | grep "reset="
compile_test gpu-tests-qk-compile.log
warps
timeout "${SWEEP_S:-300}" python3 benchmarks/ov_gemm_sweep.py \
    --out "$OUT/issue14-s17-ov-gemm-sweep2.json" --stack-out "$OUT/ov-best-packed-gemm.yaml" \
    2>&1 | grep -v "Warning\|warn" | tail -44
