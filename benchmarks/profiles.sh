# Where a decode step's (Rumik) or an unmasking forward's (OmniVoice) GPU time goes:
# benchmarks/profile_step.py over the stacks of one question, kernels and GPU time per token or
# per forward, written to $OUT/NAME.json. From the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
#   bash benchmarks/profiles.sh MODE [NAME]
# NAME defaults to the committed record's name (benchmarks/README.md quotes each record with its
# mode and commit); PROFILE_S overrides the mode's time limit.
# Rumik OSS 1 (--frames 40: 320 tokens a stack):
#   swiglu            exp74-full-noswiglu and exp74-full  -> issue14-swiglu-profile
#   rotary-split      exp74-full                          -> issue14-rotary-split-profile
#   exp74-fused-v1    exp74-full, exp74-fused and both without pdl
#                                                         -> issue14-exp74-fused-profile-v1
#   exp74-fused-v2    exp74-full and exp74-fused          -> issue14-exp74-fused-profile-v2
#   gemv-tables       exp74-full and exp74-full-pdl-tuned -> issue14-gemv-tables-profile
#   exp74-full        exp74-full, the top 30 kernels      -> issue14-exp74-full-profile
# OmniVoice (--workload ov-tput: batch 1, the recipe's 10 steps and guidance 2.5):
#   ov-packed         ov-best and ov-best-packed          -> issue14-ov-packed-profile
#   ov-fused          ov-best-packed and -fused           -> issue14-ov-fused-profile
#   ov-qkv-v3         ov-best-packed-qkv (version 3 at e88ad65) -> issue14-ov-qkv-v3-profile
#   ov-qkv-v4         ov-best-packed-qkv (version 4 at cc82bb2) -> issue14-ov-qkv-v4-profile
#   ov-qkv-v5         -qkv-v3 and -qkv in one process, inductor's generated code kept
#                     (issue14-ov-qkv-v3-v5-output-code.log.gz) -> issue14-ov-qkv-v5-profile
#   ov-inductor-pdl   -qkv and -qkv-pdl (only at 25cd9e0, as `ab.sh ov-inductor-pdl`)
#                                                         -> issue14-ov-inductor-pdl-profile
#   ov-gemm           -qkv and -gemm (after `ab.sh ov-gemm`) -> issue14-ov-gemm-profile
set -o pipefail
mode=$1
S=benchmarks/stacks
rumik() {  # rumik LIMIT NAME ARGS...: a Rumik profile at 40 frames
    timeout "${PROFILE_S:-$1}" python3 benchmarks/profile_step.py --frames 40 \
        --out "$OUT/$2.json" "${@:3}" 2>&1 | grep -v "^  "
}
ov() {  # ov LIMIT NAME TOP STACK...: an OmniVoice profile of the TOP kernel families
    timeout "${PROFILE_S:-$1}" python3 benchmarks/profile_step.py --model omnivoice \
        --workload ov-tput --top "$3" --out "$OUT/$2.json" --stacks "${@:4}" 2>&1 \
        | grep -v "^  .*us/step.*triton_poi\|Warning\|warn\|^V\|^I" | tail -30
}
case "$mode" in
swiglu)
    rumik 220 "${2:-issue14-swiglu-profile}" \
        --stacks experiments/exp74-full-noswiglu.yaml exp74-full ;;
rotary-split)
    rumik 100 "${2:-issue14-rotary-split-profile}" --stacks exp74-full ;;
exp74-fused-v1)
    rumik 260 "${2:-issue14-exp74-fused-profile-v1}" --stacks exp74-full exp74-fused \
        $S/exp74-full-nopdl.yaml $S/exp74-fused-nopdl.yaml ;;
exp74-fused-v2)
    rumik 150 "${2:-issue14-exp74-fused-profile-v2}" --stacks exp74-full exp74-fused ;;
gemv-tables)
    rumik 110 "${2:-issue14-gemv-tables-profile}" --stacks exp74-full \
        $S/exp74-full-pdl-tuned.yaml ;;
exp74-full)
    rumik 200 "${2:-issue14-exp74-full-profile}" --model rumik-oss-1 --stacks exp74-full \
        --top 30 ;;
ov-packed)
    timeout "${PROFILE_S:-150}" python3 benchmarks/profile_step.py --model omnivoice \
        --workload ov-tput --stacks ov-best ov-best-packed \
        --out "$OUT/${2:-issue14-ov-packed-profile}.json" 2>&1 | tail -8 ;;
ov-fused)
    ov 200 "${2:-issue14-ov-fused-profile}" 60 ov-best-packed $S/ov-best-packed-fused.yaml ;;
ov-qkv-v3)
    ov 90 "${2:-issue14-ov-qkv-v3-profile}" 60 $S/ov-best-packed-qkv.yaml ;;
ov-qkv-v4)
    ov 90 "${2:-issue14-ov-qkv-v4-profile}" 40 $S/ov-best-packed-qkv.yaml ;;
ov-qkv-v5)
    code=$OUT/issue14-ov-qkv-v3-v5-output-code.log
    TORCH_LOGS=output_code TORCH_LOGS_OUT="$code" ov 150 "${2:-issue14-ov-qkv-v5-profile}" 40 \
        $S/ov-best-packed-qkv-v3.yaml $S/ov-best-packed-qkv.yaml
    gzip -f "$code" ;;
ov-inductor-pdl)
    [ -f $S/ov-best-packed-qkv-pdl.yaml ] || {
        echo "ov-inductor-pdl: the stack exists only at 25cd9e0; run from that commit" >&2
        exit 2
    }
    ov 120 "${2:-issue14-ov-inductor-pdl-profile}" 40 $S/ov-best-packed-qkv.yaml \
        benchmarks/stacks/ov-best-packed-qkv-pdl.yaml ;;
ov-gemm)
    ov 120 "${2:-issue14-ov-gemm-profile}" 40 $S/ov-best-packed-qkv.yaml \
        benchmarks/stacks/ov-best-packed-gemm.yaml ;;
*) echo "usage: profiles.sh MODE [NAME]; the modes are listed at the top of benchmarks/profiles.sh" >&2
   exit 2 ;;
esac
