# Issue 14, session 15's OmniVoice device call (from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s15.sh ov   # a whole call: GPU tests, the A/B, then a profile
#   bash benchmarks/speed2_s15.sh ov2  # the same for version 5, both layouts profiled with
#                                      # inductor's generated code kept (output_code)
# ov_packed_projections version 4 writes q, k, v tokens-major ([B, S, H, D] memory), so
# cuDNN's attention output needs no copy for o_proj (session 14's qkv profile: 1.40 us a
# layer). One run, five seeds, interleaved: the recipe, -fused, -qkv-v3 (session 14's layout,
# the copy kept) and -qkv (version 4); then -qkv's profile, for its kernels per forward.
set -o pipefail
case "$1" in
ov)
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -s \
        "tests/test_omnivoice.py::test_fused_qk_norm_rope_forward_on_cuda_matches_packed" \
        "tests/test_kernels.py::test_qk_norm_rope_op_inside_torch_compile" 2>&1 \
        | tee "$OUT/gpu-tests-qkv.log" | grep -E "passed|failed|FAILED|Error|launches" | tail -8
    timeout "${RUN_S:-380}" bash benchmarks/gpu_run.sh issue14-s15-qkv --baseline ov-recipe \
        --stack benchmarks/stacks/ov-best-packed-fused.yaml \
        --stack benchmarks/stacks/ov-best-packed-qkv-v3.yaml \
        --stack benchmarks/stacks/ov-best-packed-qkv.yaml --model omnivoice --device cuda \
        --workload ov-tput-seeds --fidelity-steps 0 2>&1 | grep -v "^│" | tail -12
    [ -f "$OUT/issue14-s15-qkv.result.json" ] && rm -rf "$OUT/issue14-s15-qkv"
    timeout "${PROFILE_S:-90}" python3 benchmarks/profile_step.py --model omnivoice \
        --workload ov-tput --top 40 --out "$OUT/issue14-s15-qkv-profile.json" \
        --stacks benchmarks/stacks/ov-best-packed-qkv.yaml 2>&1 \
        | grep -v "^  .*us/step.*triton_poi\|Warning\|warn" | tail -30 ;;
ov2)
    # version 4 returned transposed views from the op: 478 kernels a forward against v3's
    # 384 (issue14-s15-qkv-profile.json). Version 5 returns [B, S, H, D] tensors; inductor's
    # code for both layouts says which copies are left and why.
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -s \
        "tests/test_omnivoice.py::test_fused_qk_norm_rope_forward_on_cuda_matches_packed" \
        "tests/test_kernels.py::test_qk_norm_rope_op_inside_torch_compile" 2>&1 \
        | tee "$OUT/gpu-tests-qkv5.log" | grep -E "passed|failed|FAILED|Error|launches" | tail -8
    timeout "${RUN_S:-300}" bash benchmarks/gpu_run.sh issue14-s15-qkv5 --baseline ov-recipe \
        --stack benchmarks/stacks/ov-best-packed-fused.yaml \
        --stack benchmarks/stacks/ov-best-packed-qkv-v3.yaml \
        --stack benchmarks/stacks/ov-best-packed-qkv.yaml --model omnivoice --device cuda \
        --workload ov-tput-seeds --fidelity-steps 0 2>&1 | grep -v "^│" | tail -12
    [ -f "$OUT/issue14-s15-qkv5.result.json" ] && rm -rf "$OUT/issue14-s15-qkv5"
    TORCH_LOGS=output_code TORCH_LOGS_OUT="$OUT/qkv-output-code.log" timeout "${PROFILE_S:-150}" \
        python3 benchmarks/profile_step.py --model omnivoice --workload ov-tput --top 40 \
        --out "$OUT/issue14-s15-qkv5-profile.json" \
        --stacks benchmarks/stacks/ov-best-packed-qkv-v3.yaml \
        benchmarks/stacks/ov-best-packed-qkv.yaml 2>&1 \
        | grep -v "^  .*us/step.*triton_poi\|Warning\|warn\|^V\|^I" | tail -30
    gzip -f "$OUT/qkv-output-code.log" ;;
*) echo "usage: speed2_s15.sh ov|ov2" >&2; exit 2 ;;
esac
