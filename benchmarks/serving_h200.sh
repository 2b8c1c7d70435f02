# Serving on the GPU in one device call (issue 34), from the repo root on the GPU host:
#   export ORCHESTRATE_CODE_SHA=<sha>; source benchmarks/device_setup.sh
#   bash benchmarks/serving_h200.sh            (about 9 minutes; carry omnivoice and pydub)
#   SERVING_PARTS="ov ov-runner" bash benchmarks/serving_h200.sh   (parts: tests rumik ov runner,
#   and ov-runner: ov-serve-gpu through the runner, ov-best-batched against ov-batched;
#   sustained-runner: serve-gpu-sustained through the runner, the overlap stack;
#   codec: the streaming codec alone, benchmarks/codec_bench.py, with one profiled decode;
#   fp8: the step's projections in bf16 and FP8, benchmarks/fp8_gemm.py;
#   step: the batched step's glue, eager against kernels, bf16 cache against FP8, profiled,
#   benchmarks/batched_step.py; STEP_FP8=1 adds FP8 projections)
# PROJECTIONS=bf16,fp8 / KV=model,fp8: the rumik part's FP8 paths (approximate) beside the exact.
# GLUE=torch,triton: the rumik part's step with its glue in kernels (batched_decode glue: triton).
# BATCH1_VS=exp74-full: the rumik part also times that single-stream stack on the same prompt
# against each path at 1 stream (ms per token, prefill and codec excluded).
# The whole script overran OmniVoice's 120 s on an H100 (cut while building): run `ov` in a
# call of its own (OV_TIMEOUT, default 120 s) where it matters.
# 1. the batched attention kernel compiled: its tests against the reference and the
#    one-stream kernel, the serving step against SDPA, graphs against eager steps;
# 2. the Rumik curve, one server at a time, baseline B at 32 streams: the batched kernel with
#    the codec between steps (`ours_triton`) and on its own CUDA stream (`ours_triton_overlap`)
#    by default (ATTENTION=sdpa,triton CODEC=sync adds masked SDPA, `ours`, as measured
#    before); each level records where its step goes (prefill, step, codec, host); then
#    sustained loads (SUSTAINED, LIVE:SECONDS: arrivals keeping LIVE streams playing);
# 3. OmniVoice at concurrency 1, 8 and 32 (ov-best), levels interleaved;
# 4. the serving workload through the runner (rumik-batched against rumik-batched-640,
#    rumik-batched-640-audio and rumik-batched-640-overlap on serve-gpu: 128 streams arriving together; each stack's
#    server teacher-forced and its sampler checked against stock's), stored, JSON kept.
set -o pipefail
parts=" ${SERVING_PARTS:-tests rumik ov runner} "
if [[ $parts == *" tests "* ]]; then
timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py \
    -k "decode_attention or serving_step or fp8 or rows or glue or quantize or e4m3 or one_row" 2>&1 | tee "$OUT/serving-gpu-tests.log" | tail -3
timeout 90 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/test_serving.py \
    tests/test_fp8_projections.py tests/test_parking.py 2>&1 \
    | tee -a "$OUT/serving-gpu-tests.log" | tail -3
fi
[[ $parts == *" codec "* ]] && timeout "${CODEC_TIMEOUT:-150}" python3 benchmarks/codec_bench.py \
    --rows "${CODEC_ROWS:-32,128,256,512}" --frames 1,4 --profile "${CODEC_PROFILE_ROWS:-512}" \
    --out "$OUT/codec.json" 2>&1 | tee "$OUT/codec.log"
[[ $parts == *" step "* ]] && timeout "${STEP_TIMEOUT:-120}" python3 benchmarks/batched_step.py \
    --rows "${STEP_ROWS:-1,64,256,512}" ${STEP_FP8:+--fp8-projections} \
    --out "$OUT/batched-step.json" 2>&1 | tee "$OUT/batched-step.log"
[[ $parts == *" fp8 "* ]] && timeout "${FP8_TIMEOUT:-90}" python3 benchmarks/fp8_gemm.py \
    --rows "${FP8_ROWS:-1,64,256,512}" --out "$OUT/fp8-gemm.json" 2>&1 | tee "$OUT/fp8-gemm.log"
[[ $parts == *" rumik "* ]] && timeout 270 python3 benchmarks/serving_bench.py --device cuda \
    --attention "${ATTENTION:-triton}" --codec "${CODEC:-sync,overlap}" \
    --admit-every "${ADMIT_EVERY:-1}" --projections "${PROJECTIONS:-bf16}" --kv "${KV:-model}" \
    --glue "${GLUE:-torch}" \
    --levels "${LEVELS:-1,32,128,256,512}" --sustained "${SUSTAINED:-128:16,384:16}" \
    ${BATCH1_VS:+--batch1-vs "$BATCH1_VS"} \
    --baseline-levels 32 --time-budget 250 \
    --out "$OUT/serving.json" 2>&1 | tee "$OUT/serving.log"
[[ $parts == *" ov "* ]] && timeout "${OV_TIMEOUT:-120}" python3 benchmarks/ov_serving_bench.py --device cuda --stack ov-best \
    --levels 1,8,32 --repeats 5 --out "$OUT/ov-serving.json" 2>&1 | tee "$OUT/ov-serving.log"
if [[ $parts == *" ov-runner "* ]]; then
    rm -f /tmp/ov-serve.db
    timeout "${OV_RUNNER_TIMEOUT:-300}" python3 -m orchestrate.cli run --stack ov-best-batched \
        --workload ov-serve-gpu --model omnivoice --device cuda --db sqlite:////tmp/ov-serve.db \
        --runs-dir /tmp/ov-serve-runs --no-mlflow --json > "$OUT/ov-serve-run.json" \
        2> "$OUT/ov-serve-run.log"
    tail -12 "$OUT/ov-serve-run.log"
fi
if [[ $parts == *" sustained-runner "* ]]; then  # serve-gpu-sustained: 128 kept playing
    rm -f /tmp/serve-sustained.db
    timeout "${SUSTAINED_RUNNER_TIMEOUT:-300}" python3 -m orchestrate.cli run \
        --stack rumik-batched-640-overlap --workload serve-gpu-sustained --model rumik-oss-1 \
        --device cuda --db sqlite:////tmp/serve-sustained.db --runs-dir /tmp/serve-sustained-runs \
        --no-mlflow --json > "$OUT/serve-sustained-run.json" 2> "$OUT/serve-sustained-run.log"
    tail -3 "$OUT/serve-sustained-run.log"
fi
[[ $parts == *" runner "* ]] || exit 0
rm -f /tmp/serve.db
timeout 330 python3 -m orchestrate.cli run --stack rumik-batched-640 \
    --stack rumik-batched-640-audio --stack rumik-batched-640-overlap --workload serve-gpu \
    --model rumik-oss-1 --device cuda --db sqlite:////tmp/serve.db --runs-dir /tmp/serve-runs \
    --no-mlflow --json > "$OUT/serve-run.json" 2> "$OUT/serve-run.log"
tail -3 "$OUT/serve-run.log"
