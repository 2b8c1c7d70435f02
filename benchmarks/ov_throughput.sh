# OmniVoice serving throughput at batch 1/2/4/8 for one device call (repo root, GPU host):
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh; bash benchmarks/ov_throughput.sh
# The compiled recipe, ov-best and the FlashInfer path, each at batch 1, 2, 4 and 8 on one
# short prompt (ov-tput); utterances/s = batch / latency, and `orchestrate figures` draws
# them. FlashInfer JIT-compiles its kernel (~105 s cold once on the H200, console output of
# benchmarks/flashinfer_smoke.py): carry the cache as
# fi-cache.tgz in the tree's root to skip that; the new cache is written back to $OUT.
# Not yet run as one script: with 12 stacks and two prompts it ran past a device call's time.
export FLASHINFER_WORKSPACE_BASE=/tmp/fi
[ -f fi-cache.tgz ] && tar xzf fi-cache.tgz -C /tmp
timeout 540 bash benchmarks/gpu_run.sh tput --baseline ov-recipe --stack ov-recipe-b2 \
    --stack ov-recipe-b4 --stack ov-recipe-b8 --stack ov-best --stack ov-best-b2 \
    --stack ov-best-b4 --stack ov-best-b8 --stack ov-flashinfer --stack ov-flashinfer-b2 \
    --stack ov-flashinfer-b4 --stack ov-flashinfer-b8 \
    --model omnivoice --device cuda --workload ov-tput --fidelity-steps 0
tar czf "$OUT/fi-cache.tgz" -C /tmp fi 2>/dev/null
