"""Where one decode step's time goes, per stack, on the GPU: a profile, not a benchmark.

    python benchmarks/profile_step.py --stacks exact-graph exp74 [--frames 40] [--out F.json]

For each stack: one timed synthesis split into LM / codec / prefill, then a torch.profiler
trace of a `--frames` generation (kernels inside CUDA graph replays are traced too) giving
GPU time and kernel launches per decode step and the top kernels by total time. The
headline comparison stays `orchestrate run`; this explains its numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from orchestrator.config import ModelSpec, load_stack, load_workload
from orchestrator.environment import capture
from orchestrator.families.rumik import FAMILY
from orchestrator.families.rumik.engine import sync
from orchestrator.families.rumik.vocab import build_prompt
from orchestrator.registry import build_stack
from orchestrator.technique import DeviceCaps


@torch.inference_mode()
def profile_stack(model: Any, name: str, frames: int, workload: Any) -> dict[str, Any]:
    dev = model.device
    engine = FAMILY.build_engine(model, build_stack(load_stack(name), DeviceCaps.probe(dev.type)))
    text = workload.prompts[0].text
    for _ in range(2):  # capture / compile, then a warm run
        synth = FAMILY.synthesize(engine, text, 42, workload)
    prompt = model.encode_prompt(build_prompt(text, workload.voice, workload.delivery))
    gen = torch.Generator(device=dev).manual_seed(42)
    engine.loop(engine, prompt, frames, workload.sampling, gen)
    sync(dev)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        out = engine.loop(engine, prompt, frames, workload.sampling, gen)
        sync(dev)
        wall = time.perf_counter() - t0
    kernels: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name].append(ev.device_time)  # microseconds
    steps = max(len(out.tokens), 1)
    gpu_us = sum(sum(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "stack": name,
        "synthesis": {
            "latency_s": synth.latency_s,
            "lm_s": synth.lm_s,
            "codec_s": synth.codec_s,
            "prefill_s": synth.prefill_s,
            "new_tokens": synth.new_tokens,
        },
        "profiled_tokens": steps,
        "wall_ms_per_token": 1e3 * wall / steps,
        "gpu_ms_per_token": gpu_us / 1e3 / steps,
        "kernels_per_token": sum(len(v) for v in kernels.values()) / steps,
        "top_kernels": [
            {
                "name": k[:90],
                "calls_per_token": len(v) / steps,
                "us_per_token": sum(v) / steps,
                "mean_us": sum(v) / len(v),
            }
            for k, v in top
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stacks", nargs="+", required=True)
    ap.add_argument("--model", default="rumik-oss-1")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--workload", default="gpu-quick")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = FAMILY.build_model(ModelSpec(preset=args.model, device=args.device, dtype=args.dtype))
    workload = load_workload(args.workload)
    rows = []
    for name in args.stacks:  # printed as each finishes: a cut-off run still says something
        rows.append(profile_stack(model, name, args.frames, workload))
        print_row(rows[-1])
    env = capture(args.device, model.config_hash())
    report = {"environment": env.model_dump(mode="json"), "frames": args.frames, "stacks": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


def print_row(r: dict[str, Any]) -> None:
    s = r["synthesis"]
    print(
        f"\n{r['stack']}: latency {s['latency_s']:.3f}s = lm {s['lm_s']:.3f} + codec "
        f"{s['codec_s']:.3f} (prefill {s['prefill_s']}) | wall {r['wall_ms_per_token']:.3f} "
        f"ms/tok, GPU {r['gpu_ms_per_token']:.3f} ms/tok, {r['kernels_per_token']:.0f} "
        "kernels/tok",
        flush=True,
    )
    for k in r["top_kernels"]:
        print(
            f"  {k['us_per_token']:9.1f} us/tok {k['calls_per_token']:6.1f}x "
            f"{k['mean_us']:7.2f} us  {k['name']}"
        )


if __name__ == "__main__":
    main()
