# An exploration job that hit a device-side assert, run again with every launch blocking
# (CUDA_LAUNCH_BLOCKING=1), so that the failing kernel is named where it fails. From the repo
# root on the GPU host, after `source benchmarks/device_setup.sh`:
#   bash benchmarks/explore_job_blocking.sh
# The job is the one of h200/issue13-explore-stock-device-assert that failed: stock, the
# champion static_kv_cache.device_sampler.graph_loop.packed_projections and the three of its
# candidates still allowed as stacks (+while_graph swap, +audio_head, +cuda_graph swap;
# +hf_generate_static is refused in a stack: Technique.stands_alone), gpu-explore workload,
# 16 fidelity steps. Writes $OUT/issue13-device-assert-blocking.{log,result.json}; the GPU
# tests it was run beside are `bash benchmarks/gpu_tests.sh profiler-pdl`.
name=issue13-device-assert-blocking
mkdir -p /tmp/blocking
stack() {  # stack NAME TECHNIQUE...
    local name=$1; shift
    { echo "name: $name"; echo "family: rumik"; echo "techniques:"
      for t in "$@"; do echo "  - name: $t"; done; } > "/tmp/blocking/$name.yaml"
}
stack champion static_kv_cache device_sampler graph_loop packed_projections
stack while-swap static_kv_cache device_sampler while_graph packed_projections
stack audio-head static_kv_cache device_sampler graph_loop packed_projections audio_head
stack cuda-graph-swap static_kv_cache device_sampler packed_projections cuda_graph
CUDA_LAUNCH_BLOCKING=1 python3 -m orchestrate.cli run --baseline stock \
    --stack /tmp/blocking/champion.yaml --stack /tmp/blocking/while-swap.yaml \
    --stack /tmp/blocking/audio-head.yaml --stack /tmp/blocking/cuda-graph-swap.yaml \
    --model rumik-oss-1 --device cuda --workload gpu-explore --fidelity-steps 16 \
    --no-mlflow --db sqlite:////tmp/blocking.db --runs-dir /tmp/blocking-runs > "$OUT/$name.log" 2>&1
echo "blocking job: exit $?"
cp /tmp/blocking-runs/*/result.json "$OUT/$name.result.json" 2>/dev/null
grep -n -B2 -A12 "Error\|assert" /tmp/blocking-runs/*/worker.log | head -60
python3 - <<'PY'
import json, glob
for f in glob.glob("/tmp/blocking-runs/*/result.json"):
    r = json.load(open(f))
    for s in r.get("stacks", []):
        print(f"{s['stack']['name']:>16} {s['status']:>8} fid_err={str(s.get('fidelity_error'))[:80]} err={str(s.get('error'))[:120]}")
PY
