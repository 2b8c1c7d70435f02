# Issue 14, OmniVoice at twice the recipe: the packed projections, measured (one device call;
# repo root on the GPU host, after `export ORCHESTRATE_CODE_SHA=<sha>; source
# benchmarks/device_setup.sh`):
#   bash benchmarks/speed2_ov.sh
# 1. the GPU test of ov_packed_projections (bf16 within rounding, 3 launches fewer a layer);
# 2. ov-recipe, ov-best and ov-best-packed in one worker on ov-tput (batch 1, the recipe's
#    10 steps and guidance 2.5), fidelity 8 steps;
# 3. kernels and GPU time per unmasking forward of ov-best and ov-best-packed.
set -o pipefail
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_omnivoice.py -k packed \
    2>&1 | grep -E "passed|failed|FAILED|Error" | tail -5
timeout 330 bash benchmarks/gpu_run.sh issue14-ov-packed --baseline ov-recipe --stack ov-best \
    --stack ov-best-packed --model omnivoice --device cuda --workload ov-tput --fidelity-steps 8 \
    2>&1 | grep -v "^│" | tail -20
timeout 150 python3 benchmarks/profile_step.py --model omnivoice --workload ov-tput \
    --stacks ov-best ov-best-packed --out "$OUT/issue14-ov-packed-profile.json" 2>&1 | tail -8
rm -rf "$OUT/issue14-ov-packed"  # the job folder; its record is copied up to $OUT
