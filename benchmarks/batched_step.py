"""Where the batched decode step's time goes at the Rumik shape (issue 34), and what the
kernel glue and an FP8 cache save: one step of BatchedDecoder (triton attention) with its
eager glue (`torch`) and with its kernels (`triton`: LayerNorm, rotary + cache write,
SwiGLU), over a bf16 cache and over an FP8 one (`_kv8`, APPROXIMATE: `kv: fp8`).

    python benchmarks/batched_step.py --rows 1,64,256,512 --context 420 --out step.json

Every row sits at cache position `--context` and stays there (rows inactive: a step computes
everything and advances nothing), so every replay does the same work. Per row count, each
variant's step is captured in a CUDA graph (a variant's glue and cache share one decoder's
buffers); the graphs replay interleaved, each replay timed by CUDA events. Also in the JSON,
unrounded, beside the GPU, versions and git SHA:
- `agree`: each variant's hidden states against `torch` (the exact glue over the bf16
  cache) on the same inputs: ||h - h_torch|| / ||h_torch|| and the share of equal sampled
  tokens (the kernel glue: exact up to rounding order; `_kv8`: approximate);
- `kernels_per_step` and GPU ms per step by kernel group, from torch.profiler over graph
  replays (`--profile-rows`);
- `floor_ms`: the step's physical floor on this GPU, from rates measured in this run (HBM
  read: environment.read_bandwidth_gb_s, a 2 GiB amax; bf16 tensor cores: the
  environment's matmul_tflop_s, an 8192^3 matmul): max(bytes / read rate, FLOPs / matmul
  rate), bytes = the weights the step reads (of the embedding table, its rows only:
  `step_weight_bytes` + rows x `embedding_row_bytes`; the records up to and including
  batched-step-fp8-gemv.json counted the whole 1.14 GB table, in `weights_read_bytes`) +
  every row's K/V up to `--context` in the bf16 cache, FLOPs = 2 x the projection and head
  weights' elements x rows (attention's FLOPs left out: small at this context).
  `of_floor` = each variant's floor / its median ms, the floor of what that variant reads
  and computes: the FP8 cache's is lower (half the cache bytes: `floor_ms_kv8`); with
  --fp8-projections, `floor_ms_kv8_fp8` counts the FP8 weights' bytes and their FLOPs at the
  e4m3 matmul rate, measured in the run like the bf16 one (environment.fp8_matmul_tflop_s;
  the head stays bf16).
- `prefill` (`--prefill 1x128,4x128`): each variant's prompt write (`write_prompts`, what a
  server's admission replays: ROWS prompts of TOKENS tokens into their cache rows) as a
  graph, timed the same way and profiled (its glue: with `triton`, the norms and SwiGLU as
  kernels and, with the FP8 cache, one quantization kernel per tensor).
- `chunks` (`--chunks 128,256`): per row count, each kernel-glue variant's step carrying C
  prompt tokens (chunked prefill: one prompt of C tokens into the scratch row) against the
  same variant's plain step, graphs interleaved: `added_ms` = the chunk's cost inside a
  step, to set against a prompt write of its own (`prefill`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from orchestrate.api.config import ModelSpec, SamplingConfig
from orchestrate.api.device import interleaved_replay_ms
from orchestrate.api.registry import get_family
from orchestrate.running.environment import capture, fp8_matmul_tflop_s, read_bandwidth_gb_s
from orchestrate.techniques.rumik.batched_decode import GLUE, BatchedDecoder
from orchestrate.techniques.rumik.cuda_graph import warm_and_capture

# kernel name fragments -> group (first match wins); the rest is "other"
GROUPS = (
    ("attention", ("_batched_split_kernel", "_batched_reduce_kernel")),
    ("glue kernels", ("_layer_norm_kernel", "_rope_cache_kernel", "_swiglu_rows_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "gemv", "splitk")),  # _fp8_gemm_kernel
    ("norm (eager)", ("layer_norm", "LayerNorm")),
    ("elementwise (eager)", ("elementwise", "vectorized", "unrolled", "CatArray", "index")),
    ("sampler/head", ("topk", "sort", "gather", "scatter", "reduce", "argmax", "softmax")),
)


def group_of(name: str) -> str:
    for group, fragments in GROUPS:
        if any(f in name for f in fragments):
            return group
    return "other"


def profile(graphs: dict[str, torch.cuda.CUDAGraph], replays: int) -> dict[str, dict]:
    """Per glue: kernels and GPU ms per replay, and ms per replay by kernel group."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = {}
    for name, graph in graphs.items():
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        by_group: dict[str, float] = defaultdict(float)
        kernels = 0
        for ev in prof.events():
            us = getattr(ev, "device_time", 0.0) or 0.0
            if ev.device_type == torch.autograd.DeviceType.CUDA and us > 0:
                by_group[group_of(ev.name)] += us / 1e3 / replays
                kernels += 1
        out[name] = {
            "kernels_per_step": kernels / replays,
            "gpu_ms_per_step": sum(by_group.values()),
            "ms_per_step_by_group": dict(sorted(by_group.items(), key=lambda kv: -kv[1])),
        }
    return out


def fill_state(dec: BatchedDecoder, context: int) -> None:
    """Every row at position `context` over random keys and values (the same draws for
    every decoder: an FP8 cache holds them rounded, with scales of 1), feeding a random
    token (id 0 is padding: its embedding is zero); inactive, so steps advance nothing."""
    gen = torch.Generator(device=dec.k.device).manual_seed(0)
    for cache in (dec.k, dec.v):
        for layer in cache:  # one layer at a time: an FP8 cache is filled through float32
            layer.copy_(torch.randn(layer.shape, generator=gen, device=layer.device))
    for scales in (dec.k_scale, dec.v_scale):
        scales.fill_(1.0)
    dec.ids.random_(1, dec.embed.shape[0], generator=gen)
    dec.pos.fill_(context)
    dec.active.zero_()
    dec.seed.copy_(torch.arange(dec.rows, device=dec.seed.device))


def set_gemm(dec: BatchedDecoder, variant: str) -> None:
    """FP8 projections' GEMM for two or more rows: kernels/fp8_gemm.py where its table has
    a tile for variants suffixed `_tgemm`, cuBLASLt otherwise; read at capture."""
    if hasattr(dec.proj, "gemm"):
        dec.proj.gemm = "triton" if variant.endswith("_tgemm") else "cublas"


def set_residual_epilogue(dec: BatchedDecoder, variant: str) -> None:
    """FP8 projections' one-row residual adds: in the GEMV epilogue, unless the variant is
    `_adds` (their add kernels), read when the variant's graph is captured."""
    if hasattr(dec.proj, "residual_epilogue"):
        dec.proj.residual_epilogue = "_adds" not in variant


def configure(dec: BatchedDecoder, variant: str) -> None:
    """The variant's projection settings on its (shared) decoder, before its capture."""
    set_residual_epilogue(dec, variant)
    set_gemm(dec, variant)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64,256,512")
    ap.add_argument("--context", type=int, default=420, help="every row's cache position")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--profile-rows", default="1,512", help="row counts profiled ('' none)")
    ap.add_argument("--preset", default="rumik-oss-1")
    ap.add_argument(
        "--prefill",
        default="",
        help="prompt writes also timed, ROWSxTOKENS comma-separated (e.g. 1x128,4x128): each "
        "variant's write_prompts (a server's admission) as a graph, profiled",
    )
    ap.add_argument(
        "--chunks",
        default="",
        help="prompt tokens a step carries (chunked prefill), comma-separated (e.g. 128,256): "
        "each kernel-glue variant's step with them against without",
    )
    ap.add_argument(
        "--unsplit",
        action="store_true",
        help="also each kernel-glue variant with its attention never split (variants "
        "suffixed _unsplit; the others split rows' positions at small row counts: "
        "BatchedDecoder.splits)",
    )
    ap.add_argument(
        "--fp8-projections",
        action="store_true",
        help="also variant triton_kv8_fp8: fp8_projections (APPROXIMATE, Hopper) on top",
    )
    ap.add_argument(
        "--fp8-gemm-triton",
        action="store_true",
        help="with --fp8-projections, also variant triton_kv8_fp8_tgemm: its GEMMs through "
        "kernels/fp8_gemm.py where its table has a tile (fp8_projections gemm: triton)",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    levels = [int(r) for r in args.rows.split(",")]
    profiled = {int(r) for r in args.profile_rows.split(",") if r}
    try:
        prefills = [tuple(map(int, s.split("x"))) for s in args.prefill.split(",") if s]
    except ValueError:
        ap.error(f"--prefill {args.prefill!r}: ROWSxTOKENS, comma-separated (e.g. 1x128)")
    if any(len(p) != 2 or min(p) < 1 or p[1] > args.context for p in prefills):
        ap.error(f"--prefill {args.prefill!r}: each ROWSxTOKENS positive, TOKENS <= --context")
    try:
        chunks = [int(c) for c in args.chunks.split(",") if c]
    except ValueError:
        ap.error(f"--chunks {args.chunks!r}: token counts, comma-separated (e.g. 128,256)")
    if any(not 0 < c <= args.context for c in chunks):
        ap.error(f"--chunks {args.chunks!r}: each positive, at most --context")
    rows = max(levels + [n for n, _ in prefills])  # the decoders' cache rows
    most = max(chunks, default=0)  # chunk_tokens needs the kernel glue at construction
    dev = torch.device("cuda")
    model = get_family("rumik").build_model(
        ModelSpec(preset=args.preset, device=dev.type, dtype="bfloat16")
    )
    # one decoder per cache dtype; a variant is (its glue, the decoder of its cache)
    chunked = {"glue": "triton", "chunk_tokens": most} if most else {}
    decs = {
        kv: BatchedDecoder(
            model, rows, args.context + 16, SamplingConfig(), "triton", kv=kv, **chunked
        )
        for kv in ("model", "fp8")
    }
    variants = {  # name -> (glue, decoder, attention splits: "auto" or 1)
        glue + ("_kv8" if kv == "fp8" else ""): (glue, decs[kv], "auto")
        for kv in decs
        for glue in GLUE
    }
    if args.fp8_projections:  # FP8 cache and FP8 projections (Hopper), the kernel glue
        from orchestrate.techniques.rumik.fp8_projections import Fp8Packed

        decs["fp8_proj"] = BatchedDecoder(
            model, rows, args.context + 16, SamplingConfig(), "triton",
            projections=Fp8Packed(model), kv="fp8", **chunked,
        )  # fmt: skip
        variants["triton_kv8_fp8"] = ("triton", decs["fp8_proj"], "auto")
        variants["triton_kv8_fp8_adds"] = ("triton", decs["fp8_proj"], "auto")
        if args.fp8_gemm_triton:
            variants["triton_kv8_fp8_tgemm"] = ("triton", decs["fp8_proj"], "auto")
    if args.unsplit:  # the kernel-glue variants again with the attention never split
        for name, (glue, d, _) in list(variants.items()):
            if glue == "triton":
                variants[name + "_unsplit"] = (glue, d, 1)
    dec = decs["model"]
    cache_per_row = dec.k[:, 0, :, : args.context].numel() * dec.k.element_size() * 2
    # A step reads its rows of the embedding table, not the table (1.14 GB at the real
    # shape, which memory()'s weights_read holds): the floors count b rows of it.
    embed_table = dec.embed.numel() * dec.embed.element_size()
    embed_row = dec.embed.shape[1] * dec.embed.element_size()
    weights = dec.memory()["weights_read"] - embed_table
    proj_elems = sum(t.numel() for t in dec.proj.tensors())
    matmul_elems = proj_elems + dec.head_w.numel()
    env = capture("cuda", "none", torch.bfloat16)  # measures the bf16 matmul rate
    ceil = {
        "read_bytes_per_s": read_bandwidth_gb_s("cuda") * 1e9,
        "bf16_flop_per_s": env.matmul_tflop_s * 1e12,
    }
    if args.fp8_projections:
        ceil["fp8_flop_per_s"] = fp8_matmul_tflop_s("cuda") * 1e12
        weights_fp8 = decs["fp8_proj"].memory()["weights_read"] - embed_table
    doc: dict = {
        "environment": env.model_dump(mode="json"),
        "model": {"preset": args.preset, "dtype": "bfloat16", "random_weights": True},
        "context": args.context,
        "attention": "triton (kernels/batched_attention.py)",
        "variants": {
            "torch": "eager glue, bf16 cache (the exact step)",
            "triton": "kernel glue, bf16 cache (exact up to rounding order)",
            "torch_kv8": "eager glue, FP8 cache quantized by quantize_rows (APPROXIMATE)",
            "triton_kv8": "kernel glue, FP8 cache quantized by the rotary kernel (APPROXIMATE)",
            "triton_kv8_fp8": "triton_kv8 with fp8_projections: e4m3 weights, activation "
            "rows quantized by the norm's and SwiGLU's kernels and (attention's output) "
            "kernels/fp8_rows.py, torch._scaled_mm (APPROXIMATE)",
            "triton_kv8_fp8_adds": "triton_kv8_fp8 with its one-row residual adds as add "
            "kernels (two a layer), not in the GEMVs' epilogue (Fp8Packed.residual_epilogue); "
            "the same at more rows",
            "triton_kv8_fp8_tgemm": "(--fp8-gemm-triton) triton_kv8_fp8 with two or more rows' "
            "GEMMs through kernels/fp8_gemm.py where its table has a tile, cuBLASLt elsewhere",
            "*_unsplit": "(--unsplit) the variant with its attention never split; the others "
            "split each row's positions across programs at small row counts "
            "(`attention_splits` per level: BatchedDecoder.splits, exact up to rounding order)",
        },
        "ceilings": ceil,
        "step_weight_bytes": weights,
        "embedding_row_bytes": embed_row,
        "cache_bytes_per_row": cache_per_row,
        "levels": [],
    }
    with torch.inference_mode():
        for d in decs.values():
            fill_state(d, args.context)
        for b in levels:
            graphs, agree = {}, {}
            for name, (glue, d, splits) in variants.items():
                d.glue, d.attention_splits = glue, splits
                configure(d, name)
                graphs[name] = warm_and_capture(lambda b=b, d=d: d.step(b, d.capacity))[0]
                agree[name] = (d._forward(b, d.capacity).float(), d.step(b, d.capacity))
            h0, t0 = agree["torch"]
            times = interleaved_replay_ms(graphs, args.replays)
            med = {name: statistics.median(t) for name, t in times.items()}
            mem_s = (weights + b * (embed_row + cache_per_row)) / ceil["read_bytes_per_s"]
            mem8_s = (weights + b * (embed_row + cache_per_row / 2)) / ceil["read_bytes_per_s"]
            flop_s = 2 * matmul_elems * b / ceil["bf16_flop_per_s"]
            floor_ms, floor8_ms = 1e3 * max(mem_s, flop_s), 1e3 * max(mem8_s, flop_s)
            floors = {name: floor8_ms if "_kv8" in name else floor_ms for name in med}
            if args.fp8_projections:
                memf_s = (weights_fp8 + b * (embed_row + cache_per_row / 2)) / ceil[
                    "read_bytes_per_s"
                ]
                proj_s = 2 * proj_elems * b / ceil["fp8_flop_per_s"]
                head_s = 2 * dec.head_w.numel() * b / ceil["bf16_flop_per_s"]
                for name in med:  # and its _unsplit twin
                    if name.startswith("triton_kv8_fp8"):
                        floors[name] = 1e3 * max(memf_s, proj_s + head_s)
            level = {
                "rows": b,
                "median_ms_per_step": med,
                "over_torch": {name: ms / med["torch"] for name, ms in med.items()},
                "floor_ms": floor_ms,
                "floor_ms_kv8": floor8_ms,
                **({"floor_ms_kv8_fp8": floors["triton_kv8_fp8"]} if args.fp8_projections else {}),
                "of_floor": {name: floors[name] / ms for name, ms in med.items()},
                "agree": {
                    name: {
                        "hidden_rel_l2": float((h - h0).norm() / h0.norm()),
                        "tokens_equal": float((t == t0).float().mean()),
                    }
                    for name, (h, t) in agree.items()
                },
                "replays": args.replays,
                "attention_splits": {
                    name: d.splits(b) if splits == "auto" else {}
                    for name, (_, d, splits) in variants.items()
                },
            }
            if b in profiled:
                level["profile"] = profile(graphs, 5)
            if chunks:
                del graphs
                level["chunks"] = [time_chunk(variants, b, c, args.replays) for c in chunks]
                graphs = {}
            doc["levels"].append(level)
            print(
                f"rows {b:4d}: "
                + ", ".join(
                    f"{n} {ms:.3f} ms ({level['over_torch'][n]:.3f}x)" for n, ms in med.items()
                )
                + f"; floor {floor_ms:.3f} ms (kv8 {floor8_ms:.3f}"
                + (f", kv8+fp8 {floors['triton_kv8_fp8']:.3f})" if args.fp8_projections else ")"),
                flush=True,
            )
            del graphs
        doc["prefill"] = [time_prefill(variants, n, t, args.replays) for n, t in prefills]
    args.out.write_text(json.dumps(doc, indent=1))


def time_chunk(variants: dict, b: int, c: int, replays: int) -> dict:
    """Each kernel-glue variant's step over b rows carrying c prompt tokens (one prompt
    into the scratch row at positions [0, c)) against its plain step, interleaved."""
    graphs = {}
    for name, (glue, d, splits) in variants.items():
        if glue != "triton":
            continue
        d.glue, d.attention_splits = glue, splits
        configure(d, name)
        gen = torch.Generator().manual_seed(c)
        ids = torch.randint(1, d.embed.shape[0], (c,), generator=gen).tolist()
        d.stage_chunk([d.scratch] * c, list(range(c)), ids, c)
        for carried in (0, c):
            step = warm_and_capture(lambda d=d, n=carried: d.step(b, d.capacity, n))[0]
            graphs[f"{name}+{carried}"] = step
    times = interleaved_replay_ms(graphs, replays)
    med = {name: statistics.median(t) for name, t in times.items()}
    names = sorted({key.rsplit("+", 1)[0] for key in med})
    added = {n: med[f"{n}+{c}"] - med[f"{n}+0"] for n in names}
    print(
        f"rows {b:4d} + chunk {c}: "
        + ", ".join(f"{n} {med[f'{n}+0']:.3f} -> {med[f'{n}+{c}']:.3f} ms" for n in names),
        flush=True,
    )
    return {"tokens": c, "median_ms_per_step": med, "added_ms": added, "replays": replays}


def time_prefill(variants: dict, rows: int, tokens: int, replays: int) -> dict:
    """Each variant's prompt write of `rows` prompts of `tokens` tokens into rows [0, rows)
    (what an admission replays), graphs interleaved, then profiled."""
    graphs = {}
    for name, (glue, d, splits) in variants.items():
        d.glue, d.attention_splits = glue, splits
        configure(d, name)
        gen = torch.Generator(device=d.ids.device).manual_seed(tokens)
        ids = torch.randint(1, d.embed.shape[0], (rows, tokens), generator=gen, device=gen.device)
        index = torch.arange(rows, device=ids.device)
        graphs[name] = warm_and_capture(lambda d=d, i=index, x=ids: d.write_prompts(i, x))[0]
    times = interleaved_replay_ms(graphs, replays)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"prefill {rows}x{tokens}: "
        + ", ".join(f"{n} {ms:.3f} ms ({ms / med['torch']:.3f}x)" for n, ms in med.items()),
        flush=True,
    )
    return {
        "rows": rows,
        "tokens": tokens,
        "median_ms_per_write": med,
        "over_torch": {name: ms / med["torch"] for name, ms in med.items()},
        "profile": profile(graphs, 3),
        "replays": replays,
    }


if __name__ == "__main__":
    main()
