# GPU tests on the device, one selection per mode, the whole console kept as a log under $OUT.
# From the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
#   bash benchmarks/gpu_tests.sh MODE [LOG]
# LOG names the log under $OUT (default: gpu-tests-MODE.log); the summary lines are printed.
# TESTS_S overrides the mode's time limit. The records each mode made are listed in
# benchmarks/README.md ("GPU tests on the device").
#   all           every GPU test in tests/ (carry optuna, omnivoice and FlashInfer's wheels
#                 in .whl/ so that every module collects)
#   kernels       tests/test_kernels.py and tests/test_gpu.py
#   fused         the same two files, the fused GEMV and into_gemv tests only
#   into-gemv     tests/test_gpu.py's into_gemv tests
#   int8          tests/test_kernels.py's INT8 GEMV tests
#   profiler-pdl  the raw-profiler kernel count against the graph's kernel nodes, and PDL
#   fidelity-omnivoice  tests/test_fidelity_slots.py, test_omnivoice.py, test_omnivoice_graph.py
#   omnivoice     tests/test_omnivoice.py
#   packed        tests/test_omnivoice.py's ov_packed_projections tests
#   qkv           the fused q/k/v kernel's two tests (forward against float32, inside compile)
#   qk-compile    the fused q/k/v kernel inside torch.compile
#   small-gemm    small_gemm's two tests (the kernel; the packed forward with it)
#   tma           the TMA GEMV at the decode shapes, and the pointer GEMV's real-shape test
#   inductor-pdl  torch_compile's `pdl` param: logits with and without PDL (the param exists
#                 only at 25cd9e0: run this mode from a checkout of that commit)
set -o pipefail
mode=$1
log=${2:-gpu-tests-$mode.log}
QKV=("tests/test_omnivoice.py::test_fused_qk_norm_rope_forward_on_cuda_matches_packed"
     "tests/test_kernels.py::test_qk_norm_rope_op_inside_torch_compile")
case "$mode" in
all) limit=560 args=(tests/ -rfE --continue-on-collection-errors) ;;
kernels) limit=200 args=(tests/test_kernels.py tests/test_gpu.py) ;;
fused) limit=150 args=(tests/test_kernels.py tests/test_gpu.py -k "fused or into_gemv") ;;
into-gemv) limit=170 args=(tests/test_gpu.py -k into_gemv) ;;
int8) limit=200 args=(tests/test_kernels.py -k int8) ;;
profiler-pdl) limit=200 args=(tests/test_gpu.py tests/test_pdl.py -k "profiler_agree or pdl") ;;
fidelity-omnivoice) limit=200 args=(tests/test_fidelity_slots.py tests/test_omnivoice.py
                                    tests/test_omnivoice_graph.py) ;;
omnivoice) limit=150 args=(tests/test_omnivoice.py) ;;
packed) limit=120 args=(tests/test_omnivoice.py -k packed) ;;
qkv) limit=90 args=(-s "${QKV[@]}") ;;
qk-compile) limit=120 args=("${QKV[1]}") ;;
small-gemm) limit=120 args=("tests/test_kernels.py::test_gpu_small_gemm_at_omnivoice_shapes"
                            "tests/test_omnivoice.py::test_small_gemm_forward_on_cuda_matches_packed") ;;
tma) limit=240 args=(-rfE "tests/test_kernels.py::test_gpu_tma_gemv_real_shapes_in_graph_with_pdl"
                     "tests/test_kernels.py::test_gpu_real_shapes_graphs_and_pdl") ;;
inductor-pdl) limit=200 args=(-rfE "tests/test_omnivoice.py::test_compiled_forward_with_pdl_equals_without") ;;
*) echo "usage: gpu_tests.sh all|kernels|fused|into-gemv|int8|profiler-pdl|fidelity-omnivoice|omnivoice|packed|qkv|qk-compile|small-gemm|tma|inductor-pdl [LOG]" >&2
   exit 2 ;;
esac
timeout "${TESTS_S:-$limit}" python3 -m pytest -q -p no:cacheprovider -m gpu "${args[@]}" 2>&1 \
    | tee "$OUT/$log" | grep -E "passed|failed|FAILED|ERROR|Error|launches" | tail -12
