# Issue 14, session 14's OmniVoice device call (from the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh):
#   bash benchmarks/speed2_s14.sh ov
# The OmniVoice GPU tests (the fused q/k norm + rotary test now bounds each bf16 path's error
# against the float32 forward; session 13's call failed its fixed bound, 0.024 > 0.02), then
# where ov-best-packed-fused's time goes: busy and span per forward, and every kernel family.
# The en20 headline goes first in its own call (benchmarks/two_gpus.sh with no GPU-1 command).
set -o pipefail
case "$1" in
ov)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_omnivoice.py 2>&1 \
        | tee "$OUT/gpu-tests-omnivoice.log" | grep -E "passed|failed|FAILED|Error" | tail -8
    timeout "${PROFILE_S:-200}" python3 benchmarks/profile_step.py --model omnivoice \
        --workload ov-tput --top 60 --out "$OUT/issue14-s14-ov-profile.json" \
        --stacks ov-best-packed benchmarks/stacks/ov-best-packed-fused.yaml 2>&1 \
        | grep -v "^  .*us/step.*triton_poi\|Warning\|warn" ;;
*) echo "usage: speed2_s14.sh ov" >&2; exit 2 ;;
esac
