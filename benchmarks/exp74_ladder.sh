# The exp74-full prefix ladder for one device call (run from the repo root on the GPU host):
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh; bash benchmarks/exp74_ladder.sh
# Stock (A), then every cumulative prefix of exp74-full (static cache, + int8, + decode
# attention, + codebook head, + fused glue, + device sampler, + PDL, + graph_loop), so the
# frontier shows where the time went. Short clips (gpu-ladder): the early prefixes run
# without CUDA graphs. Not yet run on the GPU.
timeout 560 bash benchmarks/gpu_run.sh ladder --stack exp74-full --prefixes \
    --model rumik-oss-1 --device cuda --workload gpu-ladder --fidelity-steps 0
