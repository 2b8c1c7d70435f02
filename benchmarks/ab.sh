# One interleaved run of a baseline and its candidates in one worker (an A/B), through
# benchmarks/gpu_run.sh, whose evidence comes back as $OUT/NAME.{json,result.json,events.jsonl,
# worker.log}. From the repo root on the GPU host, after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
#   bash benchmarks/ab.sh MODE [NAME]
# NAME defaults to issue14-MODE, the committed record's name (benchmarks/README.md quotes each
# record with its mode and commit); RUN_S overrides the mode's time limit. A run cut by the
# limit keeps what it measured.
# Rumik OSS 1 (real shape, random weights):
#   swiglu-vs-b         baseline-b, exp74-full-noswiglu, exp74-full (gpu-headline, 64 fidelity
#                       steps)
#   swiglu-ab           exp74-full-noswiglu against exp74-full (gpu-headline, no fidelity)
#   rotary-split        baseline-b, exp74-full, exp74-while (gpu-headline, 64 fidelity steps)
#   while-pdl           exp74-full, exp74-while and both without pdl (gpu-quick)
#   memory-per-stack    exp74-full alone in a fresh worker: its own GPU memory (gpu-quick)
#   exp74-fused-v1      exp74-full, exp74-fused and exp74-fused-nopreload (64 fidelity steps)
#   exp74-fused-v2      exp74-full against exp74-fused (64 fidelity steps)
#   exp74-fused-v3      exp74-full against exp74-fused (no fidelity)
#                       (the three exp74-fused modes ran at the commits of the kernel's three
#                       versions; at any later commit they run the shipped version)
#   exp74-full-preload  exp74-full against exp74-full-preload
#   gemv-tables-ab      exp74-full, exp74-full-pdl-tuned, exp74-full-preload (64 fidelity steps)
# OmniVoice (batch 1, the recipe's 10 steps and guidance 2.5):
#   ov-packed-tput      ov-recipe, ov-best, ov-best-packed on ov-tput (8 fidelity steps)
#   ov-packed-seeds     the same three on ov-tput-seeds (five seeds)
#   ov-fused-autotune   ov-recipe, ov-best-packed, -fused and -autotune (ov-tput-seeds)
#   ov-qkv-v4, ov-qkv-v5  ov-recipe, -fused, -qkv-v3 and -qkv (ov-tput-seeds): -qkv was
#                       ov_packed_projections version 4 at cc82bb2, version 5 at 0610427
#   ov-qkv-vs-recipe    ov-recipe against ov-best-packed-qkv (ov-tput-seeds)
#   ov-inductor-pdl     ov-recipe, -qkv and -qkv-pdl (ov-tput-seeds); torch_compile's `pdl`
#                       param and benchmarks/stacks/ov-best-packed-qkv-pdl.yaml exist only at
#                       25cd9e0 (removed with this negative result): run from that commit
#   ov-gemm             ov-recipe, -qkv and benchmarks/stacks/ov-best-packed-gemm.yaml, once
#                       `kernel_sweeps.sh ov-gemm` has written that stack and it is committed
set -o pipefail
mode=$1
name=${2:-issue14-$mode}
S=benchmarks/stacks
RUMIK=(--model rumik-oss-1 --device cuda)
OV=(--model omnivoice --device cuda)
run() {  # run LIMIT ARGS...: the run, its summary printed, the job folder dropped once copied
    timeout "${RUN_S:-$1}" bash benchmarks/gpu_run.sh "$name" "${@:2}" 2>&1 \
        | grep -v "^│" | tail -24
    [ -f "$OUT/$name.result.json" ] && rm -rf "${OUT:?}/$name"
}
case "$mode" in
swiglu-vs-b)
    run 330 --baseline baseline-b --stack experiments/exp74-full-noswiglu.yaml \
        --stack exp74-full "${RUMIK[@]}" --workload gpu-headline --fidelity-steps 64 ;;
swiglu-ab)
    run 230 --baseline experiments/exp74-full-noswiglu.yaml --stack exp74-full \
        "${RUMIK[@]}" --workload gpu-headline --fidelity-steps 0 ;;
rotary-split)
    run 300 --baseline baseline-b --stack exp74-full --stack exp74-while \
        "${RUMIK[@]}" --workload gpu-headline --fidelity-steps 64 ;;
while-pdl)
    run 400 --baseline exp74-full --stack exp74-while --stack $S/exp74-full-nopdl.yaml \
        --stack $S/exp74-while-nopdl.yaml "${RUMIK[@]}" --workload gpu-quick --fidelity-steps 0 ;;
memory-per-stack)
    run 300 --baseline exp74-full --stack exp74-full "${RUMIK[@]}" --workload gpu-quick \
        --fidelity-steps 0 ;;
exp74-fused-v1)
    run 360 --baseline exp74-full --stack exp74-fused --stack $S/exp74-fused-nopreload.yaml \
        "${RUMIK[@]}" --workload gpu-headline --fidelity-steps 64 ;;
exp74-fused-v2)
    run 280 --baseline exp74-full --stack exp74-fused "${RUMIK[@]}" --workload gpu-headline \
        --fidelity-steps 64 ;;
exp74-fused-v3)
    run 150 --baseline exp74-full --stack exp74-fused "${RUMIK[@]}" --workload gpu-headline \
        --fidelity-steps 0 ;;
exp74-full-preload)
    run 200 --baseline exp74-full --stack $S/exp74-full-preload.yaml "${RUMIK[@]}" \
        --workload gpu-headline --fidelity-steps 0 ;;
gemv-tables-ab)
    run 240 --baseline exp74-full --stack $S/exp74-full-pdl-tuned.yaml \
        --stack $S/exp74-full-preload.yaml "${RUMIK[@]}" --workload gpu-headline \
        --fidelity-steps 64 ;;
ov-packed-tput)
    run 330 --baseline ov-recipe --stack ov-best --stack ov-best-packed "${OV[@]}" \
        --workload ov-tput --fidelity-steps 8 ;;
ov-packed-seeds)
    run 200 --baseline ov-recipe --stack ov-best --stack ov-best-packed "${OV[@]}" \
        --workload ov-tput-seeds --fidelity-steps 0 ;;
ov-fused-autotune)
    run 360 --baseline ov-recipe --stack ov-best-packed --stack $S/ov-best-packed-fused.yaml \
        --stack $S/ov-best-packed-autotune.yaml "${OV[@]}" --workload ov-tput-seeds \
        --fidelity-steps 0 ;;
ov-qkv-v4 | ov-qkv-v5)
    run "$([ "$mode" = ov-qkv-v4 ] && echo 380 || echo 300)" --baseline ov-recipe --stack=$S/ov-best-packed-fused.yaml \
        --stack=$S/ov-best-packed-qkv-v3.yaml --stack=$S/ov-best-packed-qkv.yaml "${OV[@]}" \
        --workload ov-tput-seeds --fidelity-steps 0 ;;
ov-qkv-vs-recipe)
    run 330 --baseline ov-recipe --stack=$S/ov-best-packed-qkv.yaml "${OV[@]}" \
        --workload ov-tput-seeds --fidelity-steps 0 ;;
ov-inductor-pdl)
    [ -f $S/ov-best-packed-qkv-pdl.yaml ] || {
        echo "ov-inductor-pdl: torch_compile's pdl param and its stack exist only at 25cd9e0" \
            "(removed: a negative result); run this mode from a checkout of that commit" >&2
        exit 2
    }
    run 330 --baseline ov-recipe --stack=$S/ov-best-packed-qkv.yaml \
        --stack=benchmarks/stacks/ov-best-packed-qkv-pdl.yaml "${OV[@]}" \
        --workload ov-tput-seeds --fidelity-steps 0 ;;
ov-gemm)
    run 360 --baseline ov-recipe --stack=$S/ov-best-packed-qkv.yaml \
        --stack=benchmarks/stacks/ov-best-packed-gemm.yaml "${OV[@]}" \
        --workload ov-tput-seeds --fidelity-steps 0 ;;
*) echo "usage: ab.sh MODE [NAME]; the modes are listed at the top of benchmarks/ab.sh" >&2
   exit 2 ;;
esac
