"""What a stack's GPU memory is made of: a breakdown, not a benchmark.

    python benchmarks/memory_breakdown.py --stack exp74-full [--stack stock] [--out F.json]

For each stack, in a fresh process (run it once per stack for clean numbers): the model's
allocation, then each technique's own allocation as it is applied in order (the engine is
built step by step exactly as the family builds it), the warm-up's residue (CUDA graph
pools, compiled kernels' buffers, caches sized on first use), and the peak during one timed
synthesis above what was allocated when it began. The largest live CUDA tensors reachable
from Python are listed by shape and dtype, so "what dominates" is read off, not guessed.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from orchestrate.api.config import LengthPolicy, load_model_spec, load_stack, load_workload
from orchestrate.api.registry import build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.running.environment import capture

GB = 1e9


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def largest_tensors(top: int = 12) -> list[dict[str, Any]]:
    """Live CUDA tensors reachable from Python, grouped by (shape, dtype), largest first."""
    groups: Counter[tuple[str, str]] = Counter()
    counts: Counter[tuple[str, str]] = Counter()
    seen: set[int] = set()
    for obj in gc.get_objects():
        try:
            if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
                continue
        except ReferenceError:
            continue
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        key = (str(tuple(obj.shape)), str(obj.dtype))
        groups[key] += storage.nbytes()
        counts[key] += 1
    return [
        {"shape": s, "dtype": d, "count": counts[s, d], "gb": round(b / GB, 4)}
        for (s, d), b in groups.most_common(top)
    ]


@torch.inference_mode()
def breakdown(stack_name: str, model_name: str, workload_name: str) -> dict[str, Any]:
    spec = load_model_spec(model_name, device="cuda")
    family = get_family(spec.family)
    workload = load_workload(workload_name)
    base = allocated()
    model = family.build_model(spec)
    after_model = allocated()
    built = build_stack(load_stack(stack_name), DeviceCaps.probe("cuda"))
    steps = []
    # The family's build_engine, one technique at a time (stock engine, then each apply).
    engine = family.build_engine(
        model, build_stack(load_stack(stack_name).model_copy(update={"techniques": []}))
    )
    prev = allocated()
    steps.append({"step": "stock engine", "gb": round((prev - after_model) / GB, 4)})
    for technique in built.techniques:
        technique.apply(engine)
        for slot in (*technique.slots, *technique.wraps):
            engine.filled[slot] = technique.name
        now = allocated()
        steps.append({"step": technique.name, "gb": round((now - prev) / GB, 4)})
        prev = now
    if hasattr(engine, "finalize"):
        engine.finalize()
    # As the worker does: warm up on the longest clip, then each prompt x seed timed, each
    # followed by a one-frame synthesis (time to first audio), peak reset before each.
    longest = max(workload.prompts, key=lambda p: workload.length_policy.frames_for(p.text) or 0)
    for _ in range(max(1, workload.warmups)):
        family.synthesize(engine, longest.text, workload.seeds[0], workload)
    after_warm = allocated()
    one_frame = workload.model_copy(update={"length_policy": LengthPolicy(mode="fixed", frames=1)})
    timeline, peak = [], 0
    for prompt in workload.prompts:
        for seed in workload.seeds:
            torch.cuda.reset_peak_memory_stats()
            family.synthesize(engine, prompt.text, seed, workload)
            if workload.measure_ttfa:
                family.synthesize(engine, prompt.text, seed, one_frame)
            step_peak = torch.cuda.max_memory_allocated()
            peak = max(peak, step_peak)
            timeline.append(
                {
                    "prompt": prompt.id,
                    "seed": seed,
                    "allocated_gb": round(allocated() / GB, 4),
                    "peak_gb": round(step_peak / GB, 4),
                }
            )
    return {
        "stack": stack_name,
        "model": model_name,
        "config_hash": family.config_hash(model),
        "skipped": built.skipped,
        "model_gb": round((after_model - base) / GB, 4),
        "techniques": steps,
        "warmup_residue_gb": round((after_warm - prev) / GB, 4),
        "steady_gb": round(after_warm / GB, 4),
        "timed_peak_gb": round(peak / GB, 4),
        "timed_transient_gb": round((peak - after_warm) / GB, 4),
        "reserved_gb": round(torch.cuda.memory_reserved() / GB, 4),
        "timeline": timeline,
        "largest_tensors": largest_tensors(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", required=True)
    ap.add_argument("--model", default="rumik-oss-1")
    ap.add_argument("--workload", default="gpu-headline")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    b = breakdown(args.stack, args.model, args.workload)
    env = capture("cuda", b["config_hash"]).model_dump(mode="json")
    result = {"environment": env, "breakdown": b}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(
        f"{b['stack']}: model {b['model_gb']} GB; "
        + ", ".join(f"{s['step']} {s['gb']:+}" for s in b["techniques"])
    )
    print(
        f"  warm-up residue {b['warmup_residue_gb']} GB, steady {b['steady_gb']} GB, "
        f"timed peak {b['timed_peak_gb']} GB (transient {b['timed_transient_gb']} GB), "
        f"reserved {b['reserved_gb']} GB"
    )
    for step in b["timeline"]:
        print(
            f"  {step['prompt']} seed {step['seed']}: allocated {step['allocated_gb']} GB, "
            f"peak {step['peak_gb']} GB"
        )
    for t in b["largest_tensors"][:8]:
        print(f"  {t['gb']:8.3f} GB  {t['count']:4d} x {t['shape']} {t['dtype']}")


if __name__ == "__main__":
    main()
