"""Where the batched decode step's time goes at the Rumik shape (issue 34), and what the
kernel glue saves: one step of BatchedDecoder (triton attention, bf16 cache) with its eager
glue (`torch`) and with its kernels (`triton`: LayerNorm, rotary + cache write, SwiGLU).

    python benchmarks/batched_step.py --rows 1,64,256,512 --context 420 --out step.json

Every row sits at cache position `--context` and stays there (rows inactive: a step computes
everything and advances nothing), so every replay does the same work. Per row count, each
glue's step is captured in a CUDA graph over the same buffers; the graphs replay
interleaved, each replay timed by CUDA events. Also in the JSON, unrounded, beside the GPU,
versions and git SHA:
- `agree`: the glues' hidden states (max |diff| / max |h|) and sampled tokens on the same
  state (exact up to rounding order: the same fp32 maths);
- `kernels_per_step` and GPU ms per step by kernel group, from torch.profiler over graph
  replays (`--profile-rows`);
- `floor_ms`: the step's physical floor on this GPU, from ceilings measured in this run (a
  1 GiB device copy; a 8192^3 bf16 matmul): max(bytes / copy rate, FLOPs / matmul rate),
  bytes = the weights the step reads + every row's K/V up to `--context`, FLOPs = 2 x the
  projection and head weights' elements x rows (attention's FLOPs left out: small at this
  context). `of_floor` = floor_ms / median ms.
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
from orchestrate.running.environment import capture
from orchestrate.techniques.rumik.batched_decode import GLUE, BatchedDecoder
from orchestrate.techniques.rumik.cuda_graph import warm_and_capture

# kernel name fragments -> group (first match wins); the rest is "other"
GROUPS = (
    ("attention", ("_batched_split_kernel", "_batched_reduce_kernel")),
    ("glue kernels", ("_layer_norm_kernel", "_rope_cache_kernel", "_swiglu_rows_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "gemv", "splitk")),
    ("norm (eager)", ("layer_norm", "LayerNorm")),
    ("elementwise (eager)", ("elementwise", "vectorized", "unrolled", "CatArray", "index")),
    ("sampler/head", ("topk", "sort", "gather", "scatter", "reduce", "argmax", "softmax")),
)


def group_of(name: str) -> str:
    for group, fragments in GROUPS:
        if any(f in name for f in fragments):
            return group
    return "other"


def ceilings(dev: torch.device) -> dict[str, float]:
    """This GPU's copy rate (bytes/s, read + write counted) and bf16 matmul rate (FLOP/s)."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)  # 1 GiB
    b = torch.empty_like(a)
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    copy = warm_and_capture(lambda: b.copy_(a))[0]
    mm = warm_and_capture(lambda: x @ x)[0]
    t = interleaved_replay_ms({"copy": copy, "mm": mm}, 20)
    return {
        "copy_bytes_per_s": 2 * a.numel() * 2 / (statistics.median(t["copy"]) / 1e3),
        "bf16_flop_per_s": 2 * 8192**3 / (statistics.median(t["mm"]) / 1e3),
    }


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
    """Every row at position `context` over random keys and values, feeding a random token
    (id 0 is padding: its embedding is zero); inactive, so steps advance nothing."""
    gen = torch.Generator(device=dec.k.device).manual_seed(0)
    for cache in (dec.k, dec.v):
        cache.normal_(0.0, 1.0, generator=gen)
    dec.ids.random_(1, dec.embed.shape[0], generator=gen)
    dec.pos.fill_(context)
    dec.active.zero_()
    dec.seed.copy_(torch.arange(dec.rows, device=dec.seed.device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64,256,512")
    ap.add_argument("--context", type=int, default=420, help="every row's cache position")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--profile-rows", default="1,512", help="row counts profiled ('' none)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    levels = [int(r) for r in args.rows.split(",")]
    profiled = {int(r) for r in args.profile_rows.split(",") if r}
    dev = torch.device("cuda")
    model = get_family("rumik").build_model(
        ModelSpec(preset="rumik-oss-1", device="cuda", dtype="bfloat16")
    )
    dec = BatchedDecoder(model, max(levels), args.context + 16, SamplingConfig(), "triton")
    cache_per_row = dec.k[:, 0, :, : args.context].numel() * dec.k.element_size() * 2
    weights = dec.memory()["weights_read"]
    matmul_elems = sum(t.numel() for t in dec.proj.tensors()) + dec.head_w.numel()
    ceil = ceilings(dev)
    doc: dict = {
        "environment": capture("cuda", "none", torch.bfloat16).model_dump(mode="json"),
        "model": {"preset": "rumik-oss-1", "dtype": "bfloat16", "random_weights": True},
        "context": args.context,
        "attention": "triton (kernels/batched_attention.py), bf16 cache",
        "ceilings": ceil,
        "weights_read_bytes": weights,
        "cache_bytes_per_row": cache_per_row,
        "levels": [],
    }
    with torch.inference_mode():
        fill_state(dec, args.context)
        for b in levels:
            graphs, agree = {}, {}
            for glue in GLUE:
                dec.glue = glue
                graphs[glue] = warm_and_capture(lambda b=b: dec.step(b, dec.capacity))[0]
                agree[glue] = (dec._forward(b, dec.capacity).float(), dec.step(b, dec.capacity))
            (h0, t0), (h1, t1) = agree["torch"], agree["triton"]
            times = interleaved_replay_ms(graphs, args.replays)
            med = {name: statistics.median(t) for name, t in times.items()}
            mem_s = (weights + b * cache_per_row) / ceil["copy_bytes_per_s"]
            floor_ms = 1e3 * max(mem_s, 2 * matmul_elems * b / ceil["bf16_flop_per_s"])
            level = {
                "rows": b,
                "median_ms_per_step": med,
                "triton_over_torch": med["triton"] / med["torch"],
                "floor_ms": floor_ms,
                "of_floor": {name: floor_ms / ms for name, ms in med.items()},
                "agree": {
                    "hidden_max_abs_diff_over_max": float((h1 - h0).abs().max() / h0.abs().max()),
                    "tokens_equal": float((t0 == t1).float().mean()),
                },
                "replays": args.replays,
            }
            if b in profiled:
                level["profile"] = profile(graphs, 5)
            doc["levels"].append(level)
            print(
                f"rows {b:4d}: torch glue {med['torch']:.3f} ms, triton glue "
                f"{med['triton']:.3f} ms ({level['triton_over_torch']:.3f}x); floor "
                f"{floor_ms:.3f} ms; tokens equal {level['agree']['tokens_equal']:.3f}",
                flush=True,
            )
            del graphs
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
