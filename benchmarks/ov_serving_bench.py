"""OmniVoice serving: N requests of different texts arriving together, generated as one batch
(OmniVoiceFamily.synthesize_many), at each concurrency level (issue 34: utterances per second
at concurrency 32 against 1, with latency percentiles).

    python3 benchmarks/ov_serving_bench.py --device cuda --stack ov-best --levels 1,8,32 \\
        --repeats 5 --out ov-serving.json

Each level: one untimed batch first (compiles and captures its shapes), then `--repeats`
timed batches, levels interleaved round by round (1, 8, 32, 1, 8, 32, ...) so a drifting
host affects every level alike. Real shape, random weights on the GPU (quality is not
judged here); the tiny preset on the CPU says only that the path works.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_bench import environment, write  # the same record fields

# Requests of different lengths (the padded batch costs what its longest row costs).
TEXTS = [
    "Hello there.",
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you have a moment this afternoon.",
    "It rained all night, and by morning the river had climbed over the old stone bridge.",
    "Turn left at the next light.",
    "Our meeting moved to Thursday at ten, in the small room on the third floor.",
    "Thanks!",
    "She read the letter twice, folded it, and put it back in the drawer without a word.",
]

DEFINITIONS = {
    "batch_latency_s": "one batch: prompts -> every waveform on the CPU (synthesize_many's "
    "timer); every request of the batch arrived at once and finishes with it",
    "latency_p50_s, latency_p95_s": "over every request of the level's timed batches (each "
    "request's latency is its batch's); numpy linear interpolation",
    "utterances_per_s": "requests / batch latency, the median over the timed batches",
    "audio_s_per_s": "audio seconds of the batch / its latency, the median over batches",
    "vs_concurrency_1": "utterances_per_s at this level / at concurrency 1, both medians",
    "texts": "round r of a level of N < len(TEXTS) requests speaks TEXTS[(r + i) % len(TEXTS)] "
    "for i < N (concurrency 1: one text a round, each in turn); a level of N >= len(TEXTS) "
    "speaks TEXTS[i % len(TEXTS)] every round, every text in each batch (the same order: a "
    "new order is a new shape for the captured loop)",
    "gpu_profile": "--profile-gpu: one more batch of the level (round 0's texts), not timed, "
    "under the profiler: every kernel, copy and set the GPU ran (CUPTI, graph replays "
    "included), busy_ms the union over streams, busy_fraction that over the batch's wall "
    "time, and the top kernels by summed time",
}


def batch_texts(n: int, r: int) -> list[str]:
    """Round r's texts for a level of n requests (DEFINITIONS' texts)."""
    start = r if n < len(TEXTS) else 0
    return [TEXTS[(start + i) % len(TEXTS)] for i in range(n)]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--model", default=None, help="preset (default: omnivoice / tiny)")
    ap.add_argument("--stack", default=None, help="stack name or YAML (default: ov-best / stock)")
    ap.add_argument("--levels", default="1,8,32", help="concurrency levels, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed batches per level")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--profile-gpu",
        action="store_true",
        help="after the timed rounds, one more batch a level under the profiler (gpu_profile)",
    )
    ap.add_argument("--out", default="ov-serving.json")
    return ap.parse_args(argv)


def check(args: argparse.Namespace) -> list[int]:
    """The levels, or ValueError with one line, before anything is built."""
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"cannot read --levels {args.levels!r}: {exc}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--levels {args.levels!r}: each concurrency must be at least 1")
    if 1 not in levels:
        raise ValueError("--levels must include 1: every level is compared with concurrency 1")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.profile_gpu and args.device != "cuda":
        raise ValueError("--profile-gpu records GPU activity: it needs --device cuda")
    return sorted(set(levels))


def summary(batches: list[Any], n: int) -> dict[str, Any]:
    lat = [b.latency_s for b in batches]
    per_request = np.repeat(lat, n)
    return {
        "concurrency": n,
        "batches": len(batches),
        "batch_latency_s": lat,
        "latency_p50_s": float(np.percentile(per_request, 50)),
        "latency_p95_s": float(np.percentile(per_request, 95)),
        "utterances_per_s": statistics.median(n / x for x in lat),
        "audio_s_per_s": statistics.median(b.audio_s / b.latency_s for b in batches),
        "lm_s_median": statistics.median(b.lm_s for b in batches),
        "codec_s_median": statistics.median(b.codec_s for b in batches),
        "frames": batches[-1].frames,
    }


def profiled(family: Any, engine: Any, texts: list[str], seed: int, workload: Any) -> dict:
    """One more batch under the profiler (DEFINITIONS' gpu_profile)."""
    from orchestrate.api.device import device_activity, kernel_time

    t0 = time.perf_counter()
    with device_activity() as activity:
        served = family.synthesize_many(engine, texts, seed, workload)
    wall_ms = 1000 * (time.perf_counter() - t0)
    times = kernel_time(activity, top=20)
    return {
        "wall_ms": wall_ms,
        "lm_s": served.lm_s,
        "codec_s": served.codec_s,
        "busy_fraction": times["busy_ms"] / wall_ms,
        **times,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        levels = check(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from orchestrate.api.config import ModelSpec, Prompt, StackSpec, Workload, load_stack
    from orchestrate.api.registry import build_stack, get_family
    from orchestrate.api.technique import DeviceCaps

    cuda = args.device == "cuda"
    family = get_family("omnivoice")
    spec = ModelSpec(family="omnivoice", preset=args.model or ("omnivoice" if cuda else "tiny"),
                     device=args.device, dtype="bfloat16" if cuda else "float32")  # fmt: skip
    name = args.stack or ("ov-best" if cuda else None)
    stack = load_stack(name) if name else StackSpec(name="stock", family="omnivoice")
    if stack.family != "omnivoice":
        why = f"stack {stack.name!r} is for {stack.family!r}, not omnivoice"
        print(f"error: {why}", file=sys.stderr)
        return 2
    built = build_stack(stack, DeviceCaps.probe(args.device), strict=True)
    t0 = time.perf_counter()
    model = family.build_model(spec)
    engine = family.build_engine(model, built)
    build_s = time.perf_counter() - t0
    workload = Workload(
        name="ov-serving",
        prompts=[Prompt(id=f"t{i}", text=t) for i, t in enumerate(TEXTS)],
        seeds=[args.seed],
    )
    doc: dict[str, Any] = {
        "issue": 34,
        "what": "OmniVoice serving: N requests of different texts in one batch",
        "environment": environment(args.device),
        "model": {
            "preset": spec.preset,
            "dtype": spec.dtype,
            "random_weights": True,
            "build_s": build_s,
        },
        "stack": stack.model_dump(mode="json"),
        "texts": TEXTS,
        "length_policy": workload.length_policy.model_dump(mode="json"),
        "definitions": DEFINITIONS,
        "warm_up_s": {},
        "levels": [],
    }
    out = Path(args.out)
    for n in levels:  # untimed: compiles, graph captures and allocator growth per shape,
        t0 = time.perf_counter()  # each batch of texts the timed rounds will make once
        for texts in dict.fromkeys(tuple(batch_texts(n, r)) for r in range(args.repeats)):
            family.synthesize_many(engine, list(texts), args.seed, workload)
        doc["warm_up_s"][str(n)] = time.perf_counter() - t0
    timed: dict[int, list[Any]] = {n: [] for n in levels}
    for r in range(args.repeats):  # levels interleaved round by round
        for n in levels:
            texts = batch_texts(n, r)
            timed[n].append(family.synthesize_many(engine, texts, args.seed + r, workload))
    base = summary(timed[1], 1)["utterances_per_s"]
    for n in levels:
        level = summary(timed[n], n)
        level["vs_concurrency_1"] = level["utterances_per_s"] / base
        if args.profile_gpu:
            level["gpu_profile"] = profiled(family, engine, batch_texts(n, 0), args.seed, workload)
        doc["levels"].append(level)
        print(
            f"concurrency {n:3}: {level['utterances_per_s']:.3g} utterances/s "
            f"({level['vs_concurrency_1']:.2f}x concurrency 1), latency p50 "
            f"{level['latency_p50_s'] * 1e3:.0f} ms, p95 {level['latency_p95_s'] * 1e3:.0f} ms, "
            f"{level['audio_s_per_s']:.3g} audio s/s",
            flush=True,
        )
    write(out, doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
