"""Where one step's time goes, per stack, on the GPU: a profile, not a benchmark.

    python benchmarks/profile_step.py --stacks exact-graph exp74 [--frames 40] [--out F.json]
    python benchmarks/profile_step.py --model omnivoice --workload ov-gpu-quick \
        --stacks ov-recipe ov-best

A step is a generated token (Rumik) or an unmasking forward (OmniVoice). For each stack:
one warm synthesis split into LM / codec, then a torch.profiler trace (kernels inside CUDA
graph replays are traced too) of a `--frames` generation (Rumik: the token loop only) or of
one whole synthesis (OmniVoice: preprocessing and codec included), giving GPU time and
kernels per step and the top kernels by total time. The headline comparison stays
`orchestrate run`; this explains its numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orchestrate.api.config import load_model_spec, load_stack, load_workload
from orchestrate.api.device import sync
from orchestrate.api.registry import build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.running.environment import capture


def traced_call(family: Any, engine: Any, workload: Any, frames: int) -> tuple[Callable, str]:
    """The call to trace, returning how many steps it ran, and the step's name."""
    text = workload.prompts[0].text
    if family.name == "rumik":
        from orchestrate.families.rumik.vocab import build_prompt

        model = engine.model
        prompt = model.encode_prompt(build_prompt(text, workload.voice, workload.delivery))

        def tokens() -> int:
            gen = torch.Generator(device=model.device).manual_seed(42)
            return len(engine.loop(engine, prompt, frames, workload.sampling, gen).tokens)

        return tokens, "token"

    def forwards() -> int:
        return family.synthesize(engine, text, 11, workload).forward_passes or 1

    return forwards, "forward"


@torch.inference_mode()
def profile_stack(
    family: Any, model: Any, name: str, frames: int, workload: Any, top_n: int = 12
) -> dict:
    dev = model.device
    engine = family.build_engine(model, build_stack(load_stack(name), DeviceCaps.probe(dev.type)))
    for _ in range(2):  # capture / compile, then a warm run
        synth = family.synthesize(engine, workload.prompts[0].text, 42, workload)
    call, unit = traced_call(family, engine, workload, frames)
    call()
    sync(dev)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        steps = max(call(), 1)
        sync(dev)
        wall = time.perf_counter() - t0
    kernels: dict[str, list[float]] = defaultdict(list)
    starts, ends = [], []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name].append(ev.device_time)  # microseconds
            starts.append(ev.time_range.start)
            ends.append(ev.time_range.end)
    gpu_us = sum(sum(v) for v in kernels.values())
    # First kernel's start to last kernel's end: span - busy is the GPU's idle time between
    # kernels (launch gaps, inside graph replays too), the part fewer kernels would remove.
    span_us = max(ends) - min(starts) if starts else 0.0
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top_n]
    return {
        "stack": name,
        "unit": unit,
        "synthesis": {
            "latency_s": synth.latency_s,
            "lm_s": synth.lm_s,
            "codec_s": synth.codec_s,
            "prefill_s": synth.prefill_s,
            "new_tokens": synth.new_tokens,
        },
        "profiled_steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "gpu_ms_per_step": gpu_us / 1e3 / steps,
        "gpu_span_ms_per_step": span_us / 1e3 / steps,
        "kernels_per_step": sum(len(v) for v in kernels.values()) / steps,
        "top_kernels": [
            {
                "name": k[:90],
                "calls_per_step": len(v) / steps,
                "us_per_step": sum(v) / steps,
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
    ap.add_argument("--top", type=int, default=12, help="kernels kept per stack, by total time")
    args = ap.parse_args()
    spec = load_model_spec(args.model, device=args.device, dtype=args.dtype)
    family = get_family(spec.family)
    model = family.build_model(spec)
    workload = load_workload(args.workload)
    rows = []
    for name in args.stacks:  # printed as each finishes: a cut-off run still says something
        rows.append(profile_stack(family, model, name, args.frames, workload, args.top))
        print_row(rows[-1])
    env = capture(args.device, family.config_hash(model))
    report = {"environment": env.model_dump(mode="json"), "frames": args.frames, "stacks": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


def print_row(r: dict[str, Any]) -> None:
    s = r["synthesis"]
    print(
        f"\n{r['stack']}: latency {s['latency_s']:.3f}s = lm {s['lm_s']:.3f} + codec "
        f"{s['codec_s']:.3f} | per {r['unit']}: wall {r['wall_ms_per_step']:.3f} ms, "
        f"GPU busy {r['gpu_ms_per_step']:.3f} ms of a {r['gpu_span_ms_per_step']:.3f} ms span, "
        f"{r['kernels_per_step']:.0f} kernels",
        flush=True,
    )
    for k in r["top_kernels"][:12]:
        print(
            f"  {k['us_per_step']:9.1f} us/step {k['calls_per_step']:6.1f}x "
            f"{k['mean_us']:7.2f} us  {k['name']}"
        )


if __name__ == "__main__":
    main()
