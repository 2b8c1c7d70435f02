# Issue 14, session 14's OmniVoice device call (from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s14.sh ov    # OmniVoice GPU tests, and the fused stack's profile
#   bash benchmarks/speed2_s14.sh qkv   # fused_qkv_layout's GPU tests and its A/B (a whole
#                                       # call; RUN_S=190 when less device time is left)
#   bash benchmarks/speed2_s14.sh qkvprof  # its GPU tests and its profile (a short call)
# The OmniVoice GPU tests (the fused q/k norm + rotary test now bounds each bf16 path's error
# against the float32 forward; session 13's call failed its fixed bound, 0.024 > 0.02), then
# where ov-best-packed-fused's time goes: busy and span per forward, and every kernel family.
# The en20 headline goes first in its own call (benchmarks/two_gpus.sh with no GPU-1 command).
set -o pipefail
gpu_tests() {  # gpu_tests TIMEOUT LOG TEST...: the tests, their log under $OUT, a summary
    timeout "$1" python3 -m pytest -q -p no:cacheprovider -m gpu "${@:3}" 2>&1 \
        | tee "$OUT/$2" | grep -E "passed|failed|FAILED|Error" | tail -8
}
profile() {  # profile TIMEOUT NAME STACK...: profile_step.py's OmniVoice profile, 60 kernels
    timeout "$1" python3 benchmarks/profile_step.py --model omnivoice --workload ov-tput \
        --top 60 --out "$OUT/$2.json" --stacks "${@:3}" 2>&1 \
        | grep -v "^  .*us/step.*triton_poi\|Warning\|warn"
}
QKV_TESTS=("tests/test_omnivoice.py::test_fused_qk_norm_rope_forward_on_cuda_matches_packed"
           "tests/test_kernels.py::test_qk_norm_rope_op_inside_torch_compile")
case "$1" in
ov)
    gpu_tests 150 gpu-tests-omnivoice.log tests/test_omnivoice.py
    profile "${PROFILE_S:-200}" issue14-s14-ov-profile ov-best-packed \
        benchmarks/stacks/ov-best-packed-fused.yaml ;;
qkv)
    # fused_qkv_layout: its GPU tests, then the recipe, -fused and -qkv on five seeds
    gpu_tests 60 gpu-tests-qkv.log "${QKV_TESTS[@]}"
    timeout "${RUN_S:-420}" bash benchmarks/gpu_run.sh issue14-s14-qkv --baseline ov-recipe \
        --stack benchmarks/stacks/ov-best-packed-fused.yaml \
        --stack benchmarks/stacks/ov-best-packed-qkv.yaml --model omnivoice --device cuda \
        --workload ov-tput-seeds --fidelity-steps 0 2>&1 | grep -v "^│" | tail -10
    [ -f "$OUT/issue14-s14-qkv.result.json" ] && rm -rf "$OUT/issue14-s14-qkv" ;;
qkvprof)
    # the short form, for a call of under 3 minutes: the GPU tests, then -qkv's profile alone
    # (GPU-side figures, comparable with the `ov` mode's profile of -fused from another call)
    gpu_tests 60 gpu-tests-qkv.log "${QKV_TESTS[@]}"
    profile "${PROFILE_S:-90}" issue14-s14-qkv-profile benchmarks/stacks/ov-best-packed-qkv.yaml ;;
*) echo "usage: speed2_s14.sh ov|qkv|qkvprof" >&2; exit 2 ;;
esac
