# Issue 14, session 15's OmniVoice device calls (from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s15.sh ov   # GPU tests, the A/B, then -qkv's profile
#   bash benchmarks/speed2_s15.sh ov2  # GPU tests, the A/B, then v3 and -qkv profiled in one
#                                      # process with inductor's generated code kept
#   bash benchmarks/speed2_s15.sh gemm # small_gemm's GPU tests (kernel, and wired into the
#                                      # packed forward), then its sweep against cuBLAS at the
#                                      # four shapes, writing $OUT/ov-best-packed-gemm.yaml
#                                      # where a config wins (not yet run)
#   bash benchmarks/speed2_s15.sh gemm-ab  # after that stack is committed under
#                                      # benchmarks/stacks: the recipe, -qkv and -gemm, one
#                                      # run, then -gemm's profile
# The A/B: one run, five seeds, interleaved: the recipe, -fused, -qkv-v3 (session 14's
# [B, H, S, D] layout, attention's output copied for o_proj) and -qkv (tokens-major, no copy).
# `ov` ran at cc82bb2, where -qkv was ov_packed_projections version 4 (views returned from
# the op: copies under compile); `ov2` at 0610427, version 5. At later commits both run v5.
set -o pipefail
gpu_tests() {  # gpu_tests LOG: the two GPU tests of the fused q/k/v kernel
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -s \
        "tests/test_omnivoice.py::test_fused_qk_norm_rope_forward_on_cuda_matches_packed" \
        "tests/test_kernels.py::test_qk_norm_rope_op_inside_torch_compile" 2>&1 \
        | tee "$OUT/$1" | grep -E "passed|failed|FAILED|Error|launches" | tail -8
}
ab() {  # ab NAME TIMEOUT [STACK...]: one interleaved run against the recipe, its evidence
    # copied up to $OUT (default stacks: -fused, -qkv-v3, -qkv)
    local stacks=("${@:3}")
    [ ${#stacks[@]} -gt 0 ] ||
        stacks=(ov-best-packed-fused.yaml ov-best-packed-qkv-v3.yaml ov-best-packed-qkv.yaml)
    timeout "$2" bash benchmarks/gpu_run.sh "$1" --baseline ov-recipe \
        "${stacks[@]/#/--stack=benchmarks/stacks/}" --model omnivoice --device cuda \
        --workload ov-tput-seeds --fidelity-steps 0 2>&1 | grep -v "^│" | tail -12
    [ -f "$OUT/$1.result.json" ] && rm -rf "${OUT:?}/$1"
}
profile() {  # profile TIMEOUT NAME STACK...: profile_step.py's OmniVoice profile, 40 kernels
    timeout "$1" python3 benchmarks/profile_step.py --model omnivoice --workload ov-tput \
        --top 40 --out "$OUT/$2.json" --stacks "${@:3}" 2>&1 \
        | grep -v "^  .*us/step.*triton_poi\|Warning\|warn\|^V\|^I" | tail -30
}
case "$1" in
ov)
    gpu_tests gpu-tests-qkv.log
    ab issue14-s15-qkv "${RUN_S:-380}"
    profile "${PROFILE_S:-90}" issue14-s15-qkv-profile benchmarks/stacks/ov-best-packed-qkv.yaml ;;
ov2)
    gpu_tests gpu-tests-qkv5.log
    ab issue14-s15-qkv5 "${RUN_S:-300}"
    TORCH_LOGS=output_code TORCH_LOGS_OUT="$OUT/qkv-output-code.log" \
        profile "${PROFILE_S:-150}" issue14-s15-qkv5-profile \
        benchmarks/stacks/ov-best-packed-qkv-v3.yaml benchmarks/stacks/ov-best-packed-qkv.yaml
    gzip -f "$OUT/qkv-output-code.log" ;;
gemm)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
        "tests/test_kernels.py::test_gpu_small_gemm_at_omnivoice_shapes" \
        "tests/test_omnivoice.py::test_small_gemm_forward_on_cuda_matches_packed" 2>&1 \
        | tee "$OUT/gpu-tests-small-gemm.log" | grep -E "passed|failed|FAILED|Error" | tail -8
    timeout "${SWEEP_S:-400}" python3 benchmarks/ov_gemm_sweep.py \
        --out "$OUT/issue14-ov-gemm-sweep.json" --stack-out "$OUT/ov-best-packed-gemm.yaml" \
        2>&1 | grep -v "Warning\|warn" | tail -40 ;;
gemm-ab)
    ab issue14-ov-gemm "${RUN_S:-360}" ov-best-packed-qkv.yaml ov-best-packed-gemm.yaml
    profile "${PROFILE_S:-120}" issue14-ov-gemm-profile benchmarks/stacks/ov-best-packed-qkv.yaml \
        benchmarks/stacks/ov-best-packed-gemm.yaml ;;
*) echo "usage: speed2_s15.sh ov|ov2|gemm|gemm-ab" >&2; exit 2 ;;
esac
