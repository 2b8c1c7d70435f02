"""Serving many Rumik streams on one device (issue 34): our batched path against baseline B.

Builds the model once (random weights: `rumik-oss-1` bf16 on CUDA, `tiny` fp32 on the CPU),
then walks a curve of concurrency levels, ascending, interleaving at each level:
  ours       techniques/rumik/batched_server.py: continuous batching over a B-row static
             cache, per-row positions, seeded per-row top-k, a CUDA graph per (batch,
             context) bucket captured before the first level, streaming Mimi decode of each chunk;
  baseline B transformers generate() with a static cache (auto-compiled on CUDA) over one
             static batch of the level's streams (techniques/rumik/batched_baseline.py),
             at the levels in --baseline-levels only (each batch size compiles anew).
Every stream of a level arrives at t = 0 (N concurrent streams); --poisson adds levels of
Poisson arrivals for our path, --sustained levels of arrivals that keep N streams playing
(figures apart for its window). Figures per level: orchestrator/running/serving.py. The JSON
is rewritten after every level, so a run stopped by its time limit keeps what it measured.

    python benchmarks/serving_bench.py --device cuda --model rumik-oss-1 --out $OUT/serving.json
    python benchmarks/serving_bench.py --device cpu --model tiny --out /tmp/serving.json
    python benchmarks/serving_bench.py --plot serving.json [--figure serving.png]

Our paths are the product of the option lists (--attention sdpa,triton --codec sync,overlap
...: four paths), or exactly those spelled out with --path (repeatable), e.g. a plain stack
and our best in one run:

    python benchmarks/serving_bench.py --device cuda --path attention=sdpa \
        --path attention=triton,codec=overlap,glue=triton,kv=fp8,projections=fp8,codec_every=4

Bad loads (concurrency 0, beyond the cache's rows, an arrival rate without a duration) exit
2 with one line, before any model is built.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrate.api.device import device_activity, kernel_time, sync_sites
from orchestrate.running import gc_watch
from orchestrate.running.serving import (
    DEFINITIONS,
    Load,
    LoadError,
    StreamRecord,
    arrivals,
    check_load,
    drive,
    phase_breakdown,
    summarise,
    sustained,
)

FRAME_S = 0.08  # one Mimi frame: 8 tokens
TEXT = "The quick brown fox jumps over the lazy dog, and then it rests."
CPU_LEVELS, GPU_LEVELS = "1,2,4", "1,32,128,256,384,512,640"
PATHS = {"sdpa": "ours", "triton": "ours_triton"}  # --attention -> the path it records
CODECS = ("sync", "overlap")  # --codec: overlap's paths are suffixed _overlap
# --projections: fp8's paths are suffixed _fp8, fp8_triton's _fp8t (both APPROXIMATE)
PROJECTIONS = {"bf16": "", "fp8": "_fp8", "fp8_triton": "_fp8t"}
# --kv: the fp8 cache's paths are suffixed _kv8, the int4 cache's _kv4 (both APPROXIMATE)
KVS = ("model", "fp8", "int4")
KV_SUFFIX = {"model": "", "fp8": "_kv8", "int4": "_kv4"}
GLUES = ("torch", "triton")  # --glue: triton's paths are suffixed _glue (exact up to rounding)
# --codec-precision: the codec's arithmetic (chunk_codec.py); tf32 and bf16 are APPROXIMATE
CODEC_PRECISIONS = {"fp32": "", "tf32": "_ctf32", "bf16": "_cbf16"}
# What one path of ours is (--path spells each out; otherwise the comma lists' product)
PATH_KEYS = ("attention", "codec", "projections", "kv", "glue", "chunk_tokens", "pipeline",
             "codec_kv", "codec_attention", "codec_precision", "codec_every",
             "attention_block")  # fmt: skip
# The attention block a path names without an `_abN` suffix: 64, the default until
# 2026-12-07, so every earlier record's names keep their meaning (the default is 128 since).
UNSUFFIXED_BLOCK = 64


def path_name(
    attention: str,
    codec: str,
    projections: str = "bf16",
    kv: str = "model",
    glue: str = "torch",
    chunk: int = 0,
    codec_precision: str = "fp32",
    codec_every: int = 1,
    attention_block: int = UNSUFFIXED_BLOCK,
) -> str:
    overlap = "_overlap" if codec == "overlap" else ""
    fp8 = PROJECTIONS[projections] + KV_SUFFIX[kv]
    chunked = f"_chunk{chunk}" if chunk else ""
    glued = "_glue" if glue == "triton" else ""
    every = f"_cev{codec_every}" if codec_every > 1 else ""
    named = attention == "triton" and attention_block != UNSUFFIXED_BLOCK
    block = f"_ab{attention_block}" if named else ""
    return (PATHS[attention] + overlap + fp8 + glued + chunked + CODEC_PRECISIONS[codec_precision]
            + every + block)  # fmt: skip


NOT_BUILT = [
    "this curve through the runner: `orchestrate run` serves one load per job through "
    "Family.serving (batched_decode, a workload's load:); this benchmark walks many levels "
    "and baseline B in one process, building the server directly",
    "baseline B as a technique (it is a static batch, not a stepped server)",
    "the codec in its own process (--codec overlap runs it on a side CUDA stream)",
    "prefill inside the decode step (chunked prefill): an admission is a prefill of its own, "
    "reading every weight once (graphed per (rows, tokens) bucket; --admit-every gathers "
    "arrivals into fewer admissions)",
    "OmniVoice serving here (benchmarks/ov_serving_bench.py measures it: static batches of "
    "N different requests through OmniVoiceFamily.synthesize_many)",
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--model", default=None, help="preset (default: rumik-oss-1 / tiny)")
    ap.add_argument(
        "--levels", default=None, help=f"streams per level ({GPU_LEVELS} / {CPU_LEVELS})"
    )
    ap.add_argument("--baseline-levels", default=None, help="levels also run by baseline B")
    ap.add_argument("--rows", type=int, default=None, help="cache rows (default: top level)")
    ap.add_argument("--frames", type=int, default=None, help="frames per stream (80 / 4)")
    ap.add_argument("--chunk-frames", type=int, default=1, help="frames per audio chunk")
    ap.add_argument("--no-codec", action="store_true", help="leave Mimi decode out")
    ap.add_argument("--no-graphs", action="store_true", help="eager steps on CUDA too")
    ap.add_argument(
        "--attention",
        default="sdpa",
        help="our path's attention, comma-separated, each a path of its own run one after the "
        "other: sdpa (masked SDPA, path 'ours'), triton (batched kernel, path 'ours_triton')",
    )
    ap.add_argument(
        "--codec",
        default="sync",
        help="codec modes, comma-separated, each a path per attention: sync (decoded before "
        "the step returns), overlap (a side CUDA stream behind the next step; paths "
        "suffixed _overlap)",
    )
    ap.add_argument(
        "--projections",
        default="bf16",
        help="the step's projections, comma-separated, each a path per attention and codec: "
        "bf16 (the model's own weights), fp8 (fp8_projections, APPROXIMATE, Hopper, emulated "
        "on the CPU; paths suffixed _fp8, their logits' divergence from bf16 recorded)",
    )
    ap.add_argument(
        "--kv",
        default="model",
        help="the cache, comma-separated, each a path per attention, codec and projections: "
        "model (the model's dtype), fp8 (e4m3 with a scale per vector, APPROXIMATE, needs "
        "--attention triton; paths suffixed _kv8, their logits' divergence recorded), int4 "
        "(packed 4-bit with a scale per vector, likewise; paths suffixed _kv4)",
    )
    ap.add_argument(
        "--glue",
        default="torch",
        help="the step's work between projections and attention, comma-separated, each a "
        "path: torch (eager ops), triton (one kernel each: batched_decode glue: triton; needs "
        "--attention triton alone; paths suffixed _glue)",
    )
    ap.add_argument("--max-prefill-tokens", type=int, default=4096)
    ap.add_argument(
        "--codec-kv",
        choices=("gather", "ring"),
        default="gather",
        help="how the codec keeps its transformer window (families/rumik/mimi_stream.py)",
    )
    ap.add_argument(
        "--codec-attention",
        choices=("sdpa", "triton"),
        default="sdpa",
        help="the codec transformer's attention: sdpa over the gathered window, or triton "
        "(kernels/ring_attention.py: each row's ring read in place; needs --codec-kv ring)",
    )
    ap.add_argument(
        "--codec-precision",
        default="fp32",
        help="the codec's arithmetic, comma-separated, each a path: fp32 (Mimi as it ships), "
        "tf32 (its matmuls in TF32 too; APPROXIMATE; CUDA; paths suffixed _ctf32), bf16 (a "
        "bfloat16 copy of the decoder; APPROXIMATE; paths suffixed _cbf16); each approximate "
        "path's audio is compared with float32's (codec_vs_fp32)",
    )
    ap.add_argument(
        "--codec-every",
        default="1",
        help="launch the codec every N decode steps, comma-separated, each a path (N > 1: "
        "paths suffixed _cevN): the chunks completed meanwhile decoded together",
    )
    ap.add_argument(
        "--attention-block",
        default="128",
        help="positions per block of the attention kernel's unsplit launch, comma-separated, "
        "each a path: 32, 64 or 128 (not 128: needs --attention triton alone; paths other "
        "than 64 suffixed _abN, 64 being the default of earlier records; the same softmax "
        "summed in other blocks)",
    )
    ap.add_argument(
        "--chunk-tokens",
        default="0",
        help="prompt writes, comma-separated, each a path: 0, a pass of their own per "
        "admission; N, chunked prefill, at most N prompt tokens riding along each decode "
        "step (needs --glue triton alone)",
    )
    ap.add_argument(
        "--pipeline",
        default="off",
        help="off, on or off,on (each a path; on: suffixed _pipe): launch each step as soon as "
        "the last one's tokens are read back, the host's work beside it (needs --codec "
        "overlap alone, or --no-codec)",
    )
    ap.add_argument(
        "--path",
        action="append",
        default=None,
        metavar="KEY=VALUE,...",
        help="one path of ours, its options spelled out (repeatable; instead of the product of "
        "the comma lists): keys " + ", ".join(PATH_KEYS) + "; a key left out takes its "
        "default, e.g. --path attention=sdpa --path attention=triton,codec=overlap,...",
    )
    ap.add_argument(
        "--admit-every",
        type=int,
        default=1,
        help="admit waiting streams at most every N decode steps while others decode",
    )
    ap.add_argument("--poisson", default="", help="RATE:DURATION_S,... levels for our path")
    ap.add_argument(
        "--sustained",
        default="",
        help="LIVE:DURATION_S,... levels for our path: Poisson arrivals keeping LIVE streams "
        "playing, figures apart for the window (after one stream's length)",
    )
    ap.add_argument(
        "--batch1-vs",
        default=None,
        metavar="STACK",
        help="also time STACK's single-stream engine on the same prompt and frames (ms per "
        "token, prefill and codec excluded) against each path at 1 stream (--levels has 1)",
    )
    ap.add_argument("--batch1-repeats", type=int, default=5, help="timed runs of --batch1-vs")
    ap.add_argument(
        "--profile-host",
        action="store_true",
        help="profile the host (torch.profiler, CPU) over each of our levels: its top calls "
        "by self time go in the level as host_profile; those levels' timings are perturbed",
    )
    ap.add_argument(
        "--sync-sites",
        action="store_true",
        help="count the host-device synchronisations torch flags over each of our levels, by "
        "the lines of this repository that made them (host_syncs); timings perturbed",
    )
    ap.add_argument(
        "--profile-gpu",
        default=None,
        metavar="SKIP:STEPS",
        help="run each of our levels a second time, recording the GPU's activity over STEPS "
        "decode steps after its first SKIP (or SKIP 'window': from a sustained level's "
        "window, once its load is up; other levels from their first step): busy time per "
        "stream and the top kernels (gpu_profile); the level's figures are the first, "
        "unprofiled run's",
    )
    ap.add_argument(
        "--gc",
        default="on",
        choices=("on", "freeze"),
        help="Python's collector during our levels: on (as Python runs it) or freeze (the "
        "heap alive when a level starts frozen out of its collections, gc.freeze); each "
        "level records its collections either way (gc)",
    )
    ap.add_argument("--time-budget", type=float, default=400.0, help="seconds for the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="serving.json")
    ap.add_argument("--figure", default=None, help="PNG path (default: beside --out)")
    ap.add_argument("--plot", default=None, metavar="FROM_JSON", help="only draw the figure")
    return ap.parse_args(argv)


def hopper(device: str) -> bool:
    if device != "cuda":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


VS_EXACT = (
    "an APPROXIMATE path against the same attention with the model's own weights and cache: "
    "one stream's prompt, then the tokens the exact step draws greedily, teacher-forced "
    "through both: per step, the codebook logits' cosine, their largest |difference| over "
    "the exact logits' largest |value|, and whether the argmax agrees (random weights: a "
    "numeric change, not a quality judgement)"
)


CODEC_VS_FP32 = (
    "an APPROXIMATE codec precision against float32 (Mimi as it ships), the same chunk "
    "codec otherwise: ROWS streams of FRAMES seeded random codes decoded a frame at a time "
    "by both; max_abs_diff_over_peak (the largest |difference| over float32's largest "
    "|sample|) and snr_db (10 log10 of float32's energy over the difference's) over the "
    "whole audio (random weights: a numeric change, not a quality judgement)"
)


@torch.inference_mode()
def codec_vs_fp32(
    model, precision: str, kv: str, attention: str, args, rows: int = 8, frames: int = 25
) -> dict:
    from orchestrate.techniques.rumik.chunk_codec import ChunkCodec

    def audio(which: str) -> torch.Tensor:
        codec = ChunkCodec(model, rows, False, chunk_frames=1, kv=kv, attention=attention,
                           precision=which)  # fmt: skip
        index = torch.arange(rows)
        gen = torch.Generator().manual_seed(args.seed)
        shape = (rows, model.codec.config.num_quantizers, frames)
        codes = torch.randint(0, model.codec.config.codebook_size, shape, generator=gen)
        return torch.cat([codec.decode_now(index, codes[..., f : f + 1]) for f in range(frames)],
                         dim=-1).cpu()  # fmt: skip

    ref, got = audio("fp32"), audio(precision)
    diff = got - ref
    return {
        "rows": rows,
        "frames": frames,
        "max_abs_diff_over_peak": float(diff.abs().max() / ref.abs().max()),
        "snr_db": float(10 * torch.log10(ref.pow(2).sum() / diff.pow(2).sum())),
    }


@torch.inference_mode()
def divergence(
    model,
    prompt: list[int],
    sampling,
    attention: str,
    projections,
    kv: str,
    glue: str = "torch",
    steps: int = 32,
) -> dict[str, Any]:
    """What FP8 projections and/or an FP8 cache change in the step's logits (VS_EXACT);
    the exact step's glue is `glue` too."""
    from orchestrate.techniques.rumik.batched_decode import BatchedDecoder

    greedy = sampling.model_copy(update={"top_k": 1})
    capacity = len(prompt) + steps + 1
    ref = BatchedDecoder(model, 1, capacity, greedy, attention, glue=glue)
    ref.prefill([0], [prompt], [0], [False])
    tokens = [[int(ref.step(1, capacity)[0]) for _ in range(steps)]]
    # a fresh cache to teacher-force
    ref = BatchedDecoder(model, 1, capacity, greedy, attention, glue=glue)
    bf16 = [lg[0].float() for lg, _ in ref.teacher_forced([prompt], tokens)]
    del ref
    dec = BatchedDecoder(
        model, 1, capacity, greedy, attention, projections=projections, kv=kv, glue=glue
    )
    ours = [lg[0].float() for lg, _ in dec.teacher_forced([prompt], tokens)]
    pairs = list(zip(bf16, ours, strict=True))
    cos = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in pairs]
    rel = [float((a - b).abs().max() / a.abs().max()) for a, b in pairs]
    agree = [bool(a.argmax() == b.argmax()) for a, b in pairs]
    return {
        "steps": steps,
        "cosine_min": min(cos),
        "cosine_median": statistics.median(cos),
        "max_abs_diff_over_max_abs": max(rel),
        "argmax_agreement": sum(agree) / len(agree),
        "definition": VS_EXACT,
    }


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def plan(args: argparse.Namespace) -> tuple[list[Load], list[int], int]:
    """Every load of the run, checked before anything is built (LoadError on a bad one)."""
    cuda = args.device == "cuda"
    try:
        levels = ints(args.levels or (GPU_LEVELS if cuda else CPU_LEVELS))
        base = ints(
            args.baseline_levels
            if args.baseline_levels is not None
            else ("32,128" if cuda else "1,2")
        )
        poisson = [
            tuple(map(float, p.split(":"))) if ":" in p else (float(p), None)
            for p in args.poisson.split(",")
            if p.strip()
        ]
        sustains = [
            (int(p.split(":")[0]), float(p.split(":")[1]))
            for p in args.sustained.split(",")
            if p.strip()
        ]
    except ValueError as exc:
        raise LoadError(f"cannot read a level list: {exc}") from exc
    if args.sync_sites and not cuda:  # an empty count would read as "none"
        raise LoadError("--sync-sites counts CUDA synchronisations: it needs --device cuda")
    if args.profile_gpu is not None:
        if not cuda:  # no activity would read as an idle GPU
            raise LoadError("--profile-gpu records GPU activity: it needs --device cuda")
        try:
            skip, steps = profile_window(args.profile_gpu)
        except ValueError as exc:
            msg = f"--profile-gpu {args.profile_gpu!r}: SKIP:STEPS, two integers (or window:STEPS)"
            raise LoadError(msg) from exc
        if (skip is not None and skip < 0) or steps < 1:
            raise LoadError(f"--profile-gpu {args.profile_gpu!r}: SKIP >= 0 and STEPS >= 1")
        if args.profile_host:  # one torch.profiler at a time
            raise LoadError("--profile-gpu and --profile-host: one profiler a run, not both")
    specs = path_specs(args)
    for ns in specs:
        try:
            check_path_options(ns, cuda)
        except LoadError as exc:
            raise LoadError(f"--path {ns.spec!r}: {exc}" if args.path else str(exc)) from None
    names = [run_name(run) for ns in specs for run in spec_runs(ns)]
    if len(set(names)) < len(names):  # two specs apart only in the codec's window or kernel
        raise LoadError(f"two --path specs make the same path {names}: change one")
    if args.batch1_vs:
        if 1 not in levels:
            raise LoadError("--batch1-vs compares at 1 stream: --levels must include 1")
        from orchestrate.api.config import load_stack

        try:
            family = load_stack(args.batch1_vs).family
        except Exception as exc:  # unknown or malformed: said before any model is built
            raise LoadError(f"--batch1-vs: {exc}") from exc
        if family != "rumik":
            raise LoadError(f"--batch1-vs {args.batch1_vs} is a {family} stack, not rumik")
    rows = args.rows if args.rows is not None else max(levels, default=0)
    loads = [Load(concurrency=n) for n in levels]
    loads += [Load(rate=r, duration_s=d) for r, d in poisson]
    stream_s = (args.frames or (80 if cuda else 4)) * FRAME_S
    loads += [sustained(n, d, stream_s) for n, d in sustains]
    if not loads:
        raise LoadError("no load levels given")
    for load in loads:
        check_load(load, rows)
    for n in base:
        check_load(Load(concurrency=n), 1 << 30)  # baseline B has no rows: only n >= 1
    return loads, base, rows


def path_specs(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The options of our paths: `args` itself (its comma lists' product), or one namespace
    per --path, each key it leaves out at its default (LoadError on a bad spec)."""
    if not args.path:
        return [args]
    defaults = parse([])
    given = [k for k in PATH_KEYS if getattr(args, k) != getattr(defaults, k)]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise LoadError(f"--path spells out each path: drop {flags} (or put it in the --path)")
    specs = []
    for text in args.path:
        ns = argparse.Namespace(**vars(args), spec=text)
        for item in filter(None, text.split(",")):
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in PATH_KEYS or not value.strip() or "," in value:
                raise LoadError(f"--path {text!r}: KEY=VALUE pairs, each key one of "
                                f"{', '.join(PATH_KEYS)}, one value each")  # fmt: skip
            setattr(ns, key, value.strip())
        specs.append(ns)
    return specs


def spec_runs(ns: argparse.Namespace) -> list[tuple]:
    """Every path `ns` asks for: (attention, codec, projections, kv, glue, chunk tokens,
    pipelined, codec precision, codec every, codec kv, codec attention, attention block), in
    run order."""
    return [
        (a, c, p, kv, g, n, pipe == "on", cp, ce, ns.codec_kv, ns.codec_attention, ab)
        for ab in map(int, ns.attention_block.split(","))
        for ce in map(int, ns.codec_every.split(","))
        for cp in ns.codec_precision.split(",")
        for pipe in ns.pipeline.split(",")
        for n in map(int, ns.chunk_tokens.split(","))
        for g in ns.glue.split(",")
        for kv in ns.kv.split(",")
        for p in ns.projections.split(",")
        for c in ns.codec.split(",")
        for a in ns.attention.split(",")
    ]


def run_name(run: tuple) -> str:
    attention, codec, proj, kv, glue, chunk, pipe, cp, ce = run[:9]
    block = run[11]
    return path_name(attention, codec, proj, kv, glue, chunk, cp, ce, block) + "_pipe" * pipe


def check_path_options(args: argparse.Namespace, cuda: bool) -> None:
    """Our paths' options (the comma lists, or one --path's), each checked with the
    others; LoadError names the first problem."""
    unknown = [a for a in args.attention.split(",") if a not in PATHS]
    if unknown or not args.attention:
        raise LoadError(f"--attention {args.attention!r}: each one of {', '.join(PATHS)}")
    if "triton" in args.attention.split(",") and not cuda:
        raise LoadError("--attention triton needs --device cuda (a Triton kernel)")
    if args.codec_kv not in ("gather", "ring"):
        raise LoadError(f"--codec-kv {args.codec_kv!r}: gather or ring")
    if args.codec_attention not in ("sdpa", "triton"):
        raise LoadError(f"--codec-attention {args.codec_attention!r}: sdpa or triton")
    if not args.codec or any(c not in CODECS for c in args.codec.split(",")):
        raise LoadError(f"--codec {args.codec!r}: each one of {', '.join(CODECS)}")
    projections = args.projections.split(",")
    if not args.projections or any(p not in PROJECTIONS for p in projections):
        raise LoadError(f"--projections {args.projections!r}: each one of {', '.join(PROJECTIONS)}")
    fp8_on_cuda = cuda and any(p.startswith("fp8") for p in projections)
    if fp8_on_cuda and not hopper(args.device):  # the CPU emulates it
        raise LoadError("--projections fp8 on CUDA needs a Hopper GPU (sm_90: FP8 GEMM)")
    kvs = args.kv.split(",")
    if not args.kv or any(k not in KVS for k in kvs):
        raise LoadError(f"--kv {args.kv!r}: each one of {', '.join(KVS)}")
    for kv in {"fp8", "int4"} & set(kvs):
        if "sdpa" in args.attention.split(","):
            raise LoadError(f"--kv {kv} needs --attention triton alone (its kernel reads the "
                            "scales)")  # fmt: skip
    glues = args.glue.split(",")
    if not args.glue or any(g not in GLUES for g in glues):
        raise LoadError(f"--glue {args.glue!r}: each one of {', '.join(GLUES)}")
    if "triton" in glues and "sdpa" in args.attention.split(","):
        raise LoadError("--glue triton needs --attention triton alone")
    if args.codec_attention == "triton" and (args.codec_kv != "ring" or not cuda):
        raise LoadError("--codec-attention triton needs --codec-kv ring and --device cuda")
    from orchestrate.techniques.rumik.batched_decode import ATTENTION_BLOCK, ATTENTION_BLOCKS

    known = [str(b) for b in ATTENTION_BLOCKS]
    blocks = args.attention_block.split(",")
    if not args.attention_block or any(b not in known for b in blocks):
        raise LoadError(
            f"--attention-block {args.attention_block!r}: each one of {', '.join(known)}"
        )
    if blocks != [str(ATTENTION_BLOCK)] and "sdpa" in args.attention.split(","):
        raise LoadError(
            f"--attention-block other than {ATTENTION_BLOCK} needs --attention triton alone"
        )
    precisions = args.codec_precision.split(",")
    if not args.codec_precision or any(p not in CODEC_PRECISIONS for p in precisions):
        raise LoadError(
            f"--codec-precision {args.codec_precision!r}: each one of {', '.join(CODEC_PRECISIONS)}"
        )
    if "tf32" in precisions and not cuda:
        raise LoadError("--codec-precision tf32 needs --device cuda (a CUDA matmul mode)")
    try:
        everies = [int(n) for n in args.codec_every.split(",")]
    except ValueError:
        everies = []
    if not everies or min(everies) < 1:
        raise LoadError(f"--codec-every {args.codec_every!r}: each a whole number, at least 1")
    if args.no_codec and (precisions != ["fp32"] or everies != [1]):
        raise LoadError(
            "--codec-precision or --codec-every with --no-codec: there is no codec to run"
        )
    if args.no_codec and args.codec != "sync":
        raise LoadError("--codec overlap with --no-codec: there is no codec to overlap")
    if args.admit_every < 1:
        raise LoadError(f"--admit-every must be at least 1 (got {args.admit_every})")
    try:
        chunks = [int(c) for c in args.chunk_tokens.split(",")]
    except ValueError:
        chunks = [-1]
    if any(c < 0 or c > 1024 for c in chunks):
        raise LoadError(f"--chunk-tokens {args.chunk_tokens!r}: each 0 to 1024")
    if any(chunks) and glues != ["triton"]:
        raise LoadError("--chunk-tokens above 0 needs --glue triton alone")
    pipes = args.pipeline.split(",")
    if any(p not in ("off", "on") for p in pipes):
        raise LoadError(f"--pipeline {args.pipeline!r}: off, on or off,on")
    if "on" in pipes and not args.no_codec and args.codec != "overlap":
        raise LoadError("--pipeline on needs --codec overlap alone (or --no-codec)")


def environment(device: str) -> dict[str, Any]:
    import transformers

    sha = os.environ.get("ORCHESTRATE_CODE_SHA")
    if not sha:
        try:
            sha = subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            sha = None
    return {
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_sha": sha,
        "host_cpus": os.cpu_count(),
    }


def write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_ours(
    server,
    load: Load,
    prompt: list[int],
    frames: int,
    args,
    limit_s: float,
    path: str = "ours",
    gpu_window: tuple[int, int, float] | None = None,
):
    """One level of our path. `gpu_window` (SKIP, STEPS, AFTER_S; profile_start): record
    the GPU's activity over those steps (`gpu_profile`); the profiler's stop stalls the
    loop, so main() runs such a level again for its profile alone, after the measured run."""
    from orchestrate.techniques.rumik.batched_server import ServeRequest

    times = arrivals(load, args.seed)
    reqs = [
        ServeRequest(k, prompt, frames, seed=args.seed * 100_003 + k) for k in range(len(times))
    ]
    server.clear()
    trace: list[tuple[float, int]] = []
    prof = syncs = window = None
    with contextlib.ExitStack() as watch:  # each perturbs this level's timings
        if args.profile_host:  # the host's calls by self time
            from torch.profiler import ProfilerActivity, profile

            prof = watch.enter_context(profile(activities=[ProfilerActivity.CPU]))
        if args.sync_sites:  # where the host waited for the GPU, by our source line
            syncs = watch.enter_context(sync_sites(Path(__file__).resolve().parents[1]))
        collected = watch.enter_context(gc_watch.watch(freeze=args.gc == "freeze"))
        if gpu_window is not None:
            window = ProfiledSteps(server, *gpu_window)
            watch.callback(window.close)
        driven = window if window is not None else server
        records, wall = drive(driven, reqs, times, [frames] * len(reqs), limit_s, live_trace=trace)
    st = server.stats
    level = summarise(records, FRAME_S, args.chunk_frames, load, trace)
    level.update(
        path=path,
        load=load.label(),
        concurrency=load.concurrency,
        live=load.live,
        rate=load.rate,
        duration_s=load.duration_s,
        wall_s=wall,
        steps=st.steps,
        mean_step_ms=1000 * wall / st.steps if st.steps else None,
        phase_ms_per_step=phase_breakdown(server.phase_seconds(), wall, st.steps),
        mean_bucket_rows=st.step_rows / st.steps if st.steps else None,
        prefill_calls=st.prefills,
        chunk_prompt_tokens=st.chunk_tokens,
        chunk_padding_tokens=st.chunk_padding,
        buckets_used=sorted(st.buckets_used),
        gc=collected.summary(),
    )
    if prof is not None:
        level["host_profile"] = host_profile(prof)
        level["host_profile_steps"] = st.steps
    if window is not None:
        level["gpu_profile"] = window.summary()
    if syncs is not None:
        level["host_syncs"] = dict(syncs.most_common())
        level["host_syncs_steps"] = st.steps
    return level


def profile_window(value: str) -> tuple[int | None, int]:
    """--profile-gpu's (SKIP, STEPS); SKIP None for "window" (profile_start says where)."""
    skip, steps = value.split(":")
    return (None if skip == "window" else int(skip)), int(steps)


def profile_start(value: str, load: Load | None) -> tuple[int, int, float]:
    """(SKIP, STEPS, AFTER_S) of a level's profiled run: SKIP "window" starts at the first
    step once the level's sustained window opens (AFTER_S seconds in; 0 for other loads)."""
    skip, steps = profile_window(value)
    if skip is not None:
        return skip, steps, 0.0
    return 0, steps, float(getattr(load, "window_from_s", None) or 0.0)


def measured_level(
    server, load: Load, prompt: list[int], frames: int, args, deadline: float, path: str
) -> dict[str, Any]:
    """One level of our path, and with --profile-gpu the same load again for its
    `gpu_profile` alone (a failure there is recorded in it; the measured level stands)."""
    level = run_ours(server, load, prompt, frames, args, deadline - time.perf_counter() - 2.0, path)
    if args.profile_gpu:
        window = profile_start(args.profile_gpu, load)
        try:
            again = run_ours(
                server, load, prompt, frames, args, deadline - time.perf_counter() - 2.0, path,
                window,
            )  # fmt: skip
            level["gpu_profile"] = again["gpu_profile"]
        except Exception as exc:
            level["gpu_profile"] = {"error": f"{type(exc).__name__}: {exc}"}
            server.clear()
    return level


class ProfiledSteps:
    """A server whose decode steps `skip` to `skip + steps` run under `device_activity`
    (the level's steady part, not its ramp); with `after_s`, from the first step at least
    that long after the level's first; everything else passes through."""

    def __init__(
        self,
        server: Any,
        skip: int,
        steps: int,
        after_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.server, self.skip, self.steps, self.after_s = server, skip, steps, after_s
        self.clock = clock
        self.t0: float | None = None  # the level's first step
        self.done = 0
        self.profiling: contextlib.ExitStack | None = None
        self.activity: list[tuple[str, int, int, int]] = []
        self.profiled = 0
        self.wall_s = 0.0
        self.started = 0.0
        self.live_seen: list[int] = []
        self.decoding_seen: list[tuple[int, int]] = []  # (rows, positions) a step's attention
        self.first = skip  # the step it started at

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    def step(self) -> Any:
        now = self.clock()
        self.t0 = now if self.t0 is None else self.t0
        due = self.done >= self.skip and now - self.t0 >= self.after_s
        if due and self.profiling is None and not self.profiled:
            self.first = self.done
            self.profiling = contextlib.ExitStack()
            self.activity = self.profiling.enter_context(device_activity())
            self.started = time.perf_counter()
        if self.profiling is not None and hasattr(self.server, "decoding"):
            self.decoding_seen.append(self.server.decoding())  # what this step reads
        events = self.server.step()
        self.done += 1
        if self.profiling is not None:
            self.profiled += 1
            self.live_seen.append(self.server.live())
            if self.profiled == self.steps:
                self.close()
        return events

    def close(self) -> None:
        if self.profiling is not None:
            if torch.cuda.is_available():  # the window ends when its work has
                torch.cuda.synchronize()
            self.wall_s = time.perf_counter() - self.started  # before the profiler's teardown
            self.profiling.close()  # (seconds of parsing: the level's loop stalls on it)
            self.profiling = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"first_step": self.first, "steps": self.profiled}
        if self.after_s:
            out["after_s"] = self.after_s
        if not self.profiled:
            return {**out, "note": f"the level made {self.done} steps: none profiled"}
        times = kernel_time(self.activity)
        return {
            **out,
            "wall_ms": 1000 * self.wall_s,
            "live_mean": statistics.fmean(self.live_seen),
            **self.context(),
            "busy_fraction": times["busy_ms"] / (1000 * self.wall_s),
            "busy_ms_per_step": times["busy_ms"] / self.profiled,
            **times,
        }

    def context(self) -> dict[str, float]:
        """decoding_rows_mean and context_mean over the window (DEFINITIONS' gpu_profile)."""
        rows = sum(r for r, _ in self.decoding_seen)
        if not rows:
            return {}
        positions = sum(p for _, p in self.decoding_seen)
        return {
            "decoding_rows_mean": rows / len(self.decoding_seen),
            "context_mean": positions / rows,
        }


def host_profile(prof: Any, top: int = 25) -> list[dict]:
    """The host calls that took the most self time over a profiled level (CUDA runtime
    calls among them: a synchronize, a host allocation, a pageable copy is where the host
    waited for the GPU), per call and in all."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {"name": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
        for e in rows[:top]
    ]


def run_baseline(model, n: int, prompt: list[int], frames: int, sampling, args, dev: str):
    from orchestrate.techniques.rumik.batched_baseline import StaticBatchBaseline

    tokens = frames * model.vocab.num_quantizers
    base = StaticBatchBaseline(model, n, len(prompt), tokens)
    warm = base.warm_up(prompt, sampling)
    t0 = time.perf_counter()
    ready, out = base.run(
        prompt, sampling, args.seed, args.chunk_frames, not args.no_codec, lambda: sync(dev)
    )
    sync(dev)
    wall = time.perf_counter() - t0
    records = [StreamRecord(k, 0.0, frames, 0.0, list(ready), done=True) for k in range(n)]
    level = summarise(records, FRAME_S, args.chunk_frames)
    level.update(
        path="baseline_b",
        load=Load(concurrency=n).label(),
        concurrency=n,
        wall_s=wall,
        warm_up_s=warm,
        steps=int(out.shape[1]),
        mean_step_ms=1000 * wall / max(1, int(out.shape[1])),
    )
    del base
    if dev == "cuda":
        torch.cuda.empty_cache()
    return level


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.plot:
        return plot(Path(args.plot), args.figure)
    try:
        loads, base_levels, rows = plan(args)
    except LoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    deadline = start + args.time_budget
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_server import PHASES, BatchedServer
    from orchestrate.techniques.rumik.fp8_projections import Fp8Packed

    cuda = args.device == "cuda"
    preset = args.model or ("rumik-oss-1" if cuda else "tiny")
    frames = args.frames or (80 if cuda else 4)
    spec = ModelSpec(preset=preset, device=args.device, dtype="bfloat16" if cuda else "float32")
    model = get_family("rumik").build_model(spec)
    prompt = model.encode_prompt(build_prompt(TEXT, "Ira", "neutral"))
    tokens = frames * model.vocab.num_quantizers
    sampling = SamplingConfig(max_new_tokens=max(tokens, 8))
    capacity = math.ceil((len(prompt) + tokens + 1) / 128) * 128
    out = Path(args.out)
    fig = Path(args.figure) if args.figure else out.with_suffix(".png")
    doc: dict[str, Any] = {
        "issue": 34,
        "environment": environment(args.device),
        "model": {"preset": preset, "dtype": spec.dtype, "random_weights": True},
        "workload": {
            "prompt_tokens": len(prompt),
            "text": TEXT,
            "frames_per_stream": frames,
            "tokens_per_stream": tokens,
            "frame_s": FRAME_S,
            "chunk_frames": args.chunk_frames,
            "sampling": sampling.model_dump(),
            "length_policy": "fixed frames per stream; end-of-audio masked, stop head "
            "evaluated but not obeyed (random weights)",
            "arrivals": "N concurrent: all streams arrive at t = 0; poisson: seeded "
            "exponential gaps",
        },
        "ours": {
            "rows": rows,
            "cache_positions": capacity,
            "cuda_graphs": cuda and not args.no_graphs,
            "codec": "excluded"
            if args.no_codec
            else "streaming Mimi decode of each completed chunk, batched across streams, "
            "each stream's convolution tails, transformer window and position carried "
            "(families/rumik/mimi_stream.py: the whole sequence's audio, rounding apart)",
            "head": "codebook head (APPROXIMATE: codebook step % 8 per row, 2,049 columns)",
            "phases": {name: what for name, what in PHASES.items()},
            "sampler": "top-k via Gumbel-max with hashed per-row noise (same distribution "
            "as stock's top-k, other random stream)",
            "max_prefill_tokens": args.max_prefill_tokens,
            "codec_kv": "per path (paths.*.codec_kv)" if args.path else args.codec_kv,
            "codec_attention": "per path" if args.path else args.codec_attention,
            "admit_every": args.admit_every,
            "attention": {
                "ours": "SDPA over the context bucket's positions with a per-row boolean mask",
                "ours_triton": "kernels/batched_attention.py: each row over its own filled "
                "positions (one context bucket)",
                "order": "each path's server is built, warmed up and run over every level, "
                "then freed, before the next path's (one cache in GPU memory at a time)",
            },
            "projections": {
                "bf16": "the model's own bf16 weights (q,k,v,gate,up packed; o and down "
                "added into the residual)",
                "kv fp8": "APPROXIMATE: the cache in e4m3, each position's key and value "
                "vector per kv head with its own float32 scale (batched_decode kv: fp8)",
                "kv int4": "APPROXIMATE: the cache in packed 4-bit integers, two a byte, each "
                "position's key and value vector per kv head with its own float32 scale "
                "(batched_decode kv: int4, kernels/int4_cache.py)",
                "fp8": "APPROXIMATE: techniques/rumik/fp8_projections.py, e4m3 weights with "
                "a scale per output channel, activations per row, torch._scaled_mm",
                "fp8_triton": "APPROXIMATE: fp8's weights and rows, two or more rows "
                "multiplied by kernels/fp8_gemm.py (fp8_projections gemm: triton)",
            },
            "glue": {
                "torch": "eager ops between the projections and attention (fp32 LayerNorm "
                "with casts, the rotary's slices and stacks, two cache writes, SiLU, multiply)",
                "triton": "one kernel each: LayerNorm, every row's rotary + cache write at its "
                "own position, SwiGLU (batched_decode glue: triton; exact up to rounding order)",
            },
            "pipeline": "paths suffixed _pipe: each step launched as soon as the last one's "
            "tokens are read back; the phases are then host time with the GPU running the "
            "next step meanwhile, and `step` is the wait for a step's tokens",
            "chunk_tokens": {
                "0": "each admission's prompts written by a pass of their own (every weight "
                "read again), padded to a (rows, tokens) bucket's graph",
                "N": "chunked prefill (paths suffixed _chunkN): at most N prompt tokens ride "
                "along each decode step as extra rows, each written into its stream's cache "
                "row and attending over it by the kernels' row maps; the same cache up to "
                "rounding order (with kv fp8, a prompt attends over its quantized keys)",
            },
        },
        "baseline_b": {
            "what": "transformers generate(), StaticCache reused per batch size, auto "
            "torch.compile on CUDA (compile in warm_up_s, outside the timing); one static "
            "batch; full audio vocabulary (16,384 units) by a logits processor; a "
            "streamer timestamps frames (one host copy per step)",
            "levels": base_levels,
            "codec": "excluded" if args.no_codec else "as ours",
        },
        "definitions": {
            **DEFINITIONS,
            "mean_step_ms": "level wall seconds / decode steps: prefill, codec and host work "
            "included (not the graph's GPU time alone)",
            "mean_bucket_rows": "rows stepped per decode step (the batch bucket, live or not)",
            "chunk_prompt_tokens": "chunked prefill: prompt tokens the level's steps carried",
            "chunk_padding_tokens": "chunked prefill: the padding their chunk buckets added "
            "(extra rows of the step's projections, like prompt tokens)",
            "warm_up_s": "baseline B: the short generate() that compiles its step, untimed",
        },
        "not_built": NOT_BUILT,
        "levels": [],
        "skipped": [],
    }
    doc["model"]["build_s"] = time.perf_counter() - start
    if args.profile_host:
        doc["definitions"]["host_profile"] = (
            "--profile-host: torch.profiler (CPU activity) over the whole level; each host "
            "call's self milliseconds summed over the level, and its calls, top 25; "
            "host_profile_steps: that level's decode steps. The profiler's overhead perturbs "
            "every timing of a profiled level"
        )
    if args.sync_sites:
        doc["definitions"]["host_syncs"] = (
            "--sync-sites: host-device synchronisations torch flagged over the whole level "
            "(torch.cuda.set_sync_debug_mode), counted by the innermost two frames in this "
            "repository that made them; host_syncs_steps: that level's decode steps. The "
            "warnings' handling perturbs every timing of such a level"
        )
    if args.profile_gpu:
        doc["definitions"]["gpu_profile"] = (
            "--profile-gpu SKIP:STEPS: every kernel, copy and set the GPU ran (CUPTI, graph "
            "replays included) over decode steps SKIP to SKIP+STEPS (SKIP window: from the first "
            "step once a sustained level's window opens, after_s in) of a second run of the "
            "level, after the measured one (the level's other figures are that first run's, "
            "unprofiled); wall_ms from "
            "the first profiled step's launch to the window's last work done; busy_ms the union "
            "of all device intervals (busy_fraction of wall_ms); per stream (CUDA stream id) "
            "its summed ms and union busy_ms; top: names by summed ms, cut to 120 characters; "
            "decoding_rows_mean: rows sampling a step (live rows whose prompts are written and "
            "whose last token is not yet drawn), context_mean: the cache positions each of "
            "them attends over in its step (its position + 1), both read from the server's "
            "host mirror before each profiled step. "
            "The profiler perturbs the timings of the profiled steps"
        )
    if args.batch1_vs:  # before any server: its engine is freed before the first cache
        doc["batch1"] = single_stream(model, args.batch1_vs, prompt, frames, sampling, args)
        doc["definitions"]["batch1"] = BATCH1
        write(out, doc)
    runs = [run for ns in path_specs(args) for run in spec_runs(ns)]
    for which, run in enumerate(runs):  # in turn
        attention, codec, proj, kv, glue, chunk, pipe, cp, ce, codec_kv, codec_attention, ab = run
        path = run_name(run)
        fp8 = None
        if proj != "bf16":  # fp8 or fp8_triton: the same weights, another GEMM for 2+ rows
            fp8 = Fp8Packed(model, gemm="triton" if proj == "fp8_triton" else "cublas")
        vs_exact = None
        if fp8 is not None or kv != "model":
            vs_exact = divergence(model, prompt, sampling, attention, fp8, kv, glue)
        server = BatchedServer(
            model,
            rows,
            capacity,
            sampling,
            graphs=cuda and not args.no_graphs,
            codec=not args.no_codec,
            chunk_frames=args.chunk_frames,
            max_prefill_tokens=args.max_prefill_tokens,
            attention=attention,
            codec_overlap=codec == "overlap",
            admit_every=args.admit_every,
            codec_kv=codec_kv,
            codec_attention=codec_attention,
            codec_precision=cp,
            codec_every=ce,
            projections=fp8,
            kv=kv,
            glue=glue,
            chunk_tokens=chunk,
            pipeline=pipe,
            attention_block=ab,
        )
        del fp8  # the server holds it; freed with it
        about = {
            "attention": attention,
            "codec": codec,
            "projections": proj,
            "kv": kv,
            "glue": glue,
            "chunk_tokens": chunk,
            "pipeline": pipe,
            "codec_precision": cp,
            "codec_every": ce,
            "codec_kv": codec_kv,
            "codec_attention": codec_attention,
            "attention_block": ab,
        }
        if vs_exact is not None:
            about["vs_exact"] = vs_exact
        if cp != "fp32" and not args.no_codec:  # defined wherever a path records it
            about["codec_vs_fp32"] = codec_vs_fp32(model, cp, codec_kv, codec_attention, args)
            doc["definitions"]["codec_vs_fp32"] = CODEC_VS_FP32
        mine = (
            doc["ours"]
            .setdefault("paths", {})
            .setdefault(path, {**about, "phases": list(server.phases)})
        )
        t0 = time.perf_counter()
        mine["graphs_captured"] = server.warm_up()
        mine["capture_s"] = time.perf_counter() - t0
        # Parked (api/parking.py) for each of its levels, not for baseline B's, which reads
        # the model's weights: what the server holds is measured parked.
        with server.parked():
            mine["memory_bytes"] = server.memory()  # definitions: the record's `definitions`
            if cuda:  # everything allocated now: model, server, graphs' pool
                mine["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        t0 = time.perf_counter()  # untimed: first prefill, allocator and codec paths warm up
        run_ours(server, Load(concurrency=min(2, rows)), prompt, 2, args, 120.0, path)
        mine["warm_up_s"] = time.perf_counter() - t0
        write(out, doc)
        gb = {k: f"{v / 1e9:.2f} GB" for k, v in mine["memory_bytes"].items()}
        print(
            f"{path}: {mine['graphs_captured']} graphs in {mine['capture_s']:.1f} s; {gb}",
            flush=True,
        )
        for load in loads:
            n = load.concurrency
            todo = [path] + (["baseline_b"] if which == 0 and n in base_levels else [])
            for what in todo:
                left = deadline - time.perf_counter()
                need = 150.0 if (what == "baseline_b" and cuda) else 5.0  # a compile is ~70 s
                if left < need:
                    why = f"time budget: {left:.0f} s left"
                    doc["skipped"].append({"path": what, "load": load.label(), "why": why})
                    continue
                try:
                    if what == "baseline_b":
                        level = run_baseline(model, n, prompt, frames, sampling, args, args.device)
                    else:
                        with server.parked():
                            level = measured_level(
                                server, load, prompt, frames, args, deadline, path
                            )
                except Exception as exc:  # one failed level is recorded; the curve goes on
                    level = {
                        "path": what,
                        "load": load.label(),
                        "concurrency": n,
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-2000:],
                    }
                    server.clear()
                doc["levels"].append(level)
                doc["elapsed_s"] = time.perf_counter() - start
                write(out, doc)
                print(brief(level), flush=True)
        del server
        gc.collect()  # the server's graphs and codec hold it in reference cycles
        if cuda:
            torch.cuda.empty_cache()
    if args.batch1_vs and "error" not in doc["batch1"]:
        ours = batch1_ours(doc["levels"])
        theirs = doc["batch1"]["median_ms_per_token"]
        doc["batch1"]["ours"] = ours
        doc["batch1"]["ours_over_stack"] = {path: ms / theirs for path, ms in ours.items()}
        print(batch1_line(doc["batch1"]), flush=True)
    doc["complete"] = True
    write(out, doc)
    plot(out, str(fig))
    return 0


BATCH1 = (
    "ms per token at one stream, prefill and codec excluded: the single-stream stack's "
    "(generation loop seconds - its prefill seconds) / tokens, median over `repeats` runs "
    "after an untimed one; each path's (wall - prefill - codec phases) / decode steps at "
    "its 1-stream level; `ours_over_stack` > 1: ours is slower"
)


def single_stream(model, name: str, prompt: list[int], frames: int, sampling, args) -> dict:
    """`name`'s single-stream engine on the same prompt, frames and sampling (BATCH1)."""
    from orchestrate.api.config import load_stack
    from orchestrate.api.registry import build_stack, get_family
    from orchestrate.api.technique import DeviceCaps

    family = get_family("rumik")
    engine = family.build_engine(
        model, build_stack(load_stack(name), DeviceCaps.probe(args.device))
    )
    ms, runs = [], 1 + max(1, args.batch1_repeats)
    for r in range(runs):  # the first: graph capture, compilation (untimed)
        generator = torch.Generator(device=model.device).manual_seed(args.seed + r)
        sync(args.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = engine.loop(engine, prompt, frames, sampling, generator)
        sync(args.device)
        loop_s = time.perf_counter() - t0
        if gen.prefill_s is None:
            return {"stack": name, "error": "its loop reports no prefill time"}
        if r:
            ms.append(1000 * (loop_s - gen.prefill_s) / len(gen.tokens))
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"stack": name, "ms_per_token": ms, "median_ms_per_token": statistics.median(ms)}


def batch1_ours(levels: list[dict[str, Any]]) -> dict[str, float]:
    """Each path's ms per token at its 1-stream level (BATCH1)."""
    out = {}
    for lv in levels:
        phases = lv.get("phase_ms_per_step")
        if lv.get("concurrency") != 1 or not phases or not lv.get("mean_step_ms"):
            continue
        left_out = sum(v for k, v in phases.items() if k == "prefill" or k.startswith("codec"))
        out[lv["path"]] = lv["mean_step_ms"] - left_out
    return out


def batch1_line(b: dict[str, Any]) -> str:
    if "error" in b:
        return f"batch 1: {b['stack']}: {b['error']}"
    theirs = b["median_ms_per_token"]
    return "batch 1 (ms per token, prefill and codec excluded): " + ", ".join(
        [f"{b['stack']} {theirs:.3f}"]
        + [f"{p} {ms:.3f} ({ms / theirs:.3f}x)" for p, ms in b["ours"].items()]
    )


def brief(level: dict[str, Any]) -> str:
    if "error" in level:
        return f"{level['path']:12} {level['load']:>24}: ERROR {level['error']}"

    def f(x: float | None, scale: float = 1.0) -> str:
        return "-" if x is None else f"{x * scale:.3g}"

    return (
        f"{level['path']:12} {level['load']:>24}: served {level['served']}/"
        f"{level['streams']}, TTFA p50/p95/p99 {f(level['ttfa_p50_s'], 1e3)}/"
        f"{f(level['ttfa_p95_s'], 1e3)}/{f(level['ttfa_p99_s'], 1e3)} ms, RTF p50 "
        f"{f(level['rtf_p50'])}, steady p95 {f(level['steady_rtf_p95'])}, "
        f"{f(level['audio_s_per_s'])} audio s/s, step {f(level.get('mean_step_ms'))} ms"
        + "".join(f", {name} {ms:.3g}" for name, ms in level.get("phase_ms_per_step", {}).items())
        + (
            f"; sustained window: served {w['served']}/{w['streams']}, TTFA p95 "
            f"{f(w['ttfa_p95_s'], 1e3)} ms, live mean {f(w['live_mean'])}, loop ms p50/p99/max "
            f"{f(w.get('loop_ms_p50'))}/{f(w.get('loop_ms_p99'))}/{f(w.get('loop_ms_max'))}"
            if (w := level.get("sustained_window"))
            else ""
        )
        + (gpu_line(g) if (g := level.get("gpu_profile")) else "")
    )


def gpu_line(g: dict[str, Any]) -> str:
    if "note" in g or "error" in g:
        return f"; gpu profile: {g.get('note') or g['error']}"
    streams = ", ".join(
        f"stream {s} {v['busy_ms'] / g['steps']:.3g}" for s, v in g["streams"].items()
    )
    return (
        f"; gpu profile over {g['steps']} steps (live mean {g['live_mean']:.3g}"
        + (f", context mean {g['context_mean']:.4g}" if "context_mean" in g else "")
        + f"): busy "
        f"{g['busy_ms_per_step']:.3g} ms a step ({100 * g['busy_fraction']:.1f}% of wall), "
        f"{streams} ms a step; top: "
        + "; ".join(f"{t['name'][:40]} {t['ms'] / g['steps']:.3g}" for t in g["top"][:6])
    )


HATCHES, HATCH_NAMES = (None, "//", "..", "xx"), ("plain", "hatched", "dotted", "crossed")


def level_key(level: dict[str, Any]) -> str:
    """A level's tick: "N" for N streams together, "sN" for a sustained N."""
    return f"s{level['live']}" if level.get("live") else str(level.get("concurrency"))


def phase_bars(ax: Any, doc: dict[str, Any]) -> None:
    """Where each of our paths' step goes, per level: stacked ms per decode step by phase
    (levels recorded before phases were timed are left out)."""
    levels = [lv for lv in doc["levels"] if lv.get("phase_ms_per_step") and "error" not in lv]
    paths = list(dict.fromkeys(lv["path"] for lv in levels))  # in the order they ran
    labels, _ = curve_styles(doc)
    xs = sorted({level_key(lv) for lv in levels}, key=lambda k: (k[0] == "s", int(k.strip("s"))))
    if not paths or not xs:
        ax.set_axis_off()
        ax.set_title("phases not recorded in this file")
        return
    width = 0.8 / len(paths)
    phases = list(dict.fromkeys(k for lv in levels for k in lv["phase_ms_per_step"]))
    colors = {ph: f"C{i + 3}" for i, ph in enumerate(phases)}
    labelled: set[str] = set()
    for j, path in enumerate(paths):
        by_n = {level_key(lv): lv for lv in levels if lv["path"] == path}
        for i, n in enumerate(xs):
            if n not in by_n:
                continue
            bottom = 0.0
            for ph in phases:
                ms = max(0.0, by_n[n]["phase_ms_per_step"].get(ph, 0.0))
                label = None if ph in labelled else ph
                labelled.add(ph)
                ax.bar(
                    i + (j - (len(paths) - 1) / 2) * width,
                    ms,
                    width * 0.9,
                    bottom=bottom,
                    color=colors[ph],
                    label=label,
                    hatch=HATCHES[j % len(HATCHES)],
                )
                bottom += ms
    ax.axhline(10.0, color="grey", lw=0.8, ls=":")  # 100 tokens per audio second
    ax.set_xticks(range(len(xs)), xs)
    ax.set(
        xlabel="streams (sN: sustained N)\nbars left to right: "
        + ", ".join(
            f"{labels[p][2]} ({HATCH_NAMES[j % len(HATCHES)]})" for j, p in enumerate(paths)
        ),
        ylabel="ms per decode step",
        title="where a step goes (real time: under 10 ms)",
    )


MARKERS = "o^DvPXh*p<>d"


def curve_styles(doc: dict) -> tuple[dict[str, tuple[str, str, str]], str]:
    """Every path the record has levels of, in order: its (marker style, colour, label), and
    the name prefix all of ours share (left out of their labels: legends stay readable).
    Baseline B keeps its dashed squares."""
    names = list(dict.fromkeys(lv["path"] for lv in doc["levels"] if lv.get("path")))
    ours = [n.split("_") for n in names if n != "baseline_b"]
    shared: list[str] = []
    for parts in zip(*ours, strict=False) if len(ours) > 1 else ():
        if len(set(parts)) > 1 or len(shared) + 1 >= min(map(len, ours)):
            break
        shared.append(parts[0])
    prefix = "_".join(shared)
    styles = {}
    for k, name in enumerate(n for n in names if n != "baseline_b"):
        label = name[len(prefix) + 1 :] if prefix else name
        styles[name] = (MARKERS[k % len(MARKERS)] + "-", f"C{(k + 2) % 10}", label)
    if "baseline_b" in names:
        styles["baseline_b"] = ("s--", "C1", "baseline_b")
    return styles, prefix


def plot(src: Path, figure: str | None) -> int:
    """Streams vs TTFA p95 and vs per-stream RTF, ours and baseline B; skipped (exit 0,
    one line) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: figure skipped (draw it later with --plot)")
        return 0
    doc = json.loads(src.read_text())
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.4))
    paths, shared = curve_styles(doc)
    for path, (style, color, label) in paths.items():
        rows = sorted(
            (
                lv
                for lv in doc["levels"]
                if lv.get("path") == path and lv.get("concurrency") and "error" not in lv
            ),
            key=lambda lv: lv["concurrency"],
        )
        if not rows:
            continue
        x = [lv["concurrency"] for lv in rows]
        ttfa = [None if lv["ttfa_p95_s"] is None else lv["ttfa_p95_s"] * 1e3 for lv in rows]
        ax1.plot(x, ttfa, style, color=color, label=label)
        ax2.plot(x, [lv["rtf_p50"] for lv in rows], style, color=color, label=f"{label} p50")
        ax2.plot(
            x, [lv["steady_rtf_p95"] for lv in rows], ":", color=color, label=f"{label} steady p95"
        )
    for path, (style, color, label) in paths.items():  # sustained: the window's, x = live
        sus = sorted(
            (
                lv
                for lv in doc["levels"]
                if lv.get("path") == path and lv.get("sustained_window") and "error" not in lv
            ),
            key=lambda lv: lv.get("live") or 0,
        )
        if not sus:
            continue
        x = [lv.get("live") for lv in sus]
        win = [lv["sustained_window"] for lv in sus]
        ttfa = [None if w["ttfa_p95_s"] is None else w["ttfa_p95_s"] * 1e3 for w in win]
        kw = dict(color=color, marker=style[0], ls="--", mfc="none")
        ax1.plot(x, ttfa, label=f"{label} sustained", **kw)
        ax2.plot(x, [w["rtf_p50"] for w in win], label=f"{label} sustained p50", **kw)
    ax1.axhline(200, color="grey", lw=0.8, ls=":")
    streams = "streams (together at t = 0; hollow, dashed: sustained, its window)"
    ax1.set(xlabel=streams, ylabel="TTFA p95 (ms)", title="time to first audio")
    ax2.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax2.set(xlabel=streams, ylabel="per-stream RTF", title="per-stream RTF")
    phase_bars(ax3, doc)
    for ax in (ax1, ax2, ax3):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    env = doc["environment"]
    fig.suptitle(
        f"Rumik {doc['model']['preset']} serving on {env['device']} "
        f"(torch {env['torch']}, {str(env.get('git_sha'))[:8]})"
        + (f"; every path of ours is {shared}_..." if shared else ""),
        fontsize=9,
    )
    fig.tight_layout()
    dest = Path(figure) if figure else src.with_suffix(".png")
    fig.savefig(dest, dpi=120)
    print(f"figure: {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
