# Session 10, call 1 (repo root, GPU host, after `source benchmarks/device_setup.sh`):
# 1. the GPU test of session 9's raw-profiler kernel count, with test_pdl.py;
# 2. session 9's device-side assert (explore -s9b): its job again, stock + the champion +
#    the three candidates still allowed as stacks (hf_generate_static is now refused in a
#    stack), every launch blocking, so the failing kernel is named where it fails.
python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_pdl.py -k "profiler_agree or pdl" 2>&1 | tail -8
mkdir -p /tmp/s9b
stack() {  # stack NAME TECHNIQUE...
    local name=$1; shift
    { echo "name: $name"; echo "family: rumik"; echo "techniques:"
      for t in "$@"; do echo "  - name: $t"; done; } > "/tmp/s9b/$name.yaml"
}
stack champion static_kv_cache device_sampler graph_loop packed_projections
stack while-swap static_kv_cache device_sampler while_graph packed_projections
stack audio-head static_kv_cache device_sampler graph_loop packed_projections audio_head
stack cuda-graph-swap static_kv_cache device_sampler packed_projections cuda_graph
CUDA_LAUNCH_BLOCKING=1 python3 -m orchestrate.cli run --baseline stock \
    --stack /tmp/s9b/champion.yaml --stack /tmp/s9b/while-swap.yaml \
    --stack /tmp/s9b/audio-head.yaml --stack /tmp/s9b/cuda-graph-swap.yaml \
    --model rumik-oss-1 --device cuda --workload gpu-explore --fidelity-steps 16 \
    --no-mlflow --db sqlite:////tmp/s9b.db --runs-dir /tmp/s9b-runs > "$OUT/s9b-blocking.log" 2>&1
echo "s9b job: exit $?"
cp /tmp/s9b-runs/*/result.json "$OUT/s9b-blocking.result.json" 2>/dev/null
grep -n -B2 -A12 "Error\|assert" /tmp/s9b-runs/*/worker.log | head -60
python3 - <<'PY'
import json, glob
for f in glob.glob("/tmp/s9b-runs/*/result.json"):
    r = json.load(open(f))
    for s in r.get("stacks", []):
        print(f"{s['stack']['name']:>16} {s['status']:>8} fid_err={str(s.get('fidelity_error'))[:80]} err={str(s.get('error'))[:120]}")
PY
