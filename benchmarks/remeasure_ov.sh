# OmniVoice re-measured after the architecture move (issue 10): every GPU test, then its best
# stack against A on the committed record's workload (h200/issue5-omnivoice-best.result.json:
# ov-best S 0.0053 RTF). Run from the repo root on the GPU host after
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
set -o pipefail
timeout 270 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
    tests/test_omnivoice.py tests/test_omnivoice_graph.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
timeout 280 bash benchmarks/gpu_run.sh ov-remeasure --stack ov-best \
    --model omnivoice --device cuda --workload ov-gpu-quick
