"""Where fp8_projections' time goes at the Rumik shape (issue 34): a step's 36 layers of
projections (q,k,v,gate,up packed; o; down), four ways:

  bf16:       F.linear over the bf16 weights (what the exact server runs)
  fp8:        fp8_linear: each activation row quantized by one kernel
              (kernels/fp8_rows.py), then torch._scaled_mm with row-wise scales, or at one
              row int8_gemv's GEMV over the e4m3 row and weights (what fp8_projections runs)
  fp8_torch_quant: the same with the quantization in torch's ops (nine kernels; what
              fp8_projections ran before the kernel)
  fp8_gemm:   torch._scaled_mm alone over activations quantized beforehand (the GEMM's
              share: what a quantization fused into the producing kernel would leave)
  fp8_triton: the same operands as fp8_projections' `gemm: triton` multiplies them:
              kernels/fp8_gemm.py where its table has a tile, cuBLASLt elsewhere
  fp8_triton_fast: the same with the tensor cores' own accumulation over all of K
              (Triton's default on sm_90; cuBLASLt's use_fast_accum), for its cost
Each row count also records each FP8 way's largest error against the float32 product of the
dequantized operands (relative to the largest |value|): fp8_gemm's is cuBLASLt's.

    python benchmarks/fp8_gemm.py --rows 1,64,256,512 --out fp8-gemm.json
    python benchmarks/fp8_gemm.py --sweep --rows 16,64,128,256,384,512 --out sweep.json

`--sweep` times, per row count and per projection shape (36 distinct weights of it in one
graph), cuBLASLt against every candidate tile of the Triton kernel and `config_for`'s
choice, all interleaved: the table `config_for` is written from. `--inductor` adds one more
contender: torch._scaled_mm compiled by inductor with max-autotune (its Triton templates,
persistent TMA ones included, benchmarked against cuBLASLt at that exact shape; what it
picked is in inductor's AUTOTUNE lines on stderr), to say whether a better GEMM than ours
exists at these row counts before we write one.

Per row count, each way runs its 108 projections (3 per layer, distinct weights) in one CUDA
graph; the graphs replay interleaved, each replay timed by CUDA events. The JSON gives each
way's median ms per step, unrounded, with the GPU, versions and git SHA, and the weight
bytes a step of each format reads: `read_gb_s` = those bytes / the median (at one row the
step is a weight stream; compare with the environment's read_bandwidth_gb_s).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from orchestrate.api.device import interleaved_replay_ms
from orchestrate.running.environment import capture
from orchestrate.techniques.rumik.cuda_graph import warm_and_capture
from orchestrate.techniques.rumik.fp8_projections import (
    Fp8Weight,
    fp8_linear,
    fp8_matmul,
    quantize_rows,
)
from orchestrate.techniques.rumik.kernels.fp8_gemm import GemmConfig, config_for
from orchestrate.techniques.rumik.kernels.fp8_gemm import fp8_gemm as triton_gemm

LAYERS, HIDDEN, QKVGU, INTER = 36, 2048, 25_088, 11_008
ERROR_WAYS = ("fp8_gemm", "fp8_triton", "fp8_triton_fast")
# (input features, output features) of each layer's three projections
SHAPES = ((HIDDEN, QKVGU), (HIDDEN, HIDDEN), (INTER, HIDDEN))


def bf16(xs: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
    for x, w in zip(xs, weights, strict=True):
        F.linear(x, w)


def fp8_full(xs: list[torch.Tensor], weights: list[Fp8Weight]) -> None:
    for x, w in zip(xs, weights, strict=True):
        fp8_linear(x, w, emulate=False)


def fp8_torch_quant(xs: list[torch.Tensor], weights: list[Fp8Weight]) -> None:
    for x, w in zip(xs, weights, strict=True):
        q, s = quantize_rows(x)
        torch._scaled_mm(q, w.q.t(), scale_a=s, scale_b=w.scale, out_dtype=torch.bfloat16)


def fp8_gemm(xq: list[tuple[torch.Tensor, torch.Tensor]], weights: list[Fp8Weight]) -> None:
    for (q, s), w in zip(xq, weights, strict=True):
        torch._scaled_mm(q, w.q.t(), scale_a=s, scale_b=w.scale, out_dtype=torch.bfloat16)


def fp8_triton(
    xq: list[tuple[torch.Tensor, torch.Tensor]],
    weights: list[Fp8Weight],
    config: GemmConfig | None = None,
) -> list[torch.Tensor]:
    return [triton_gemm(q, s, w.q, w.scale, config) for (q, s), w in zip(xq, weights, strict=True)]


def fp8_served(
    xq: list[tuple[torch.Tensor, torch.Tensor]], weights: list[Fp8Weight], fast: bool = False
) -> list[torch.Tensor]:
    """What fp8_projections' `gemm: triton` runs: the table's tile, else cuBLASLt."""
    out = []
    for (q, s), w in zip(xq, weights, strict=True):
        cfg = config_for(q.shape[0], w.q.shape[0], w.q.shape[1])
        if cfg is not None and fast:
            out.append(triton_gemm(q, s, w.q, w.scale, replace(cfg, precise=False)))
        else:
            out.append(fp8_matmul(q, s, w, False, torch.bfloat16, gemm="triton"))
    return out


def worst_error(ys: list[torch.Tensor], xq, weights: list[Fp8Weight]) -> float:
    """Largest |y - float32 product| over the largest |product|, over the projections."""
    worst = 0.0
    for y, (q, s), w in zip(ys, xq, weights, strict=True):
        ref = (q.float() * s) @ (w.q.float() * w.scale.t()).t()
        worst = max(worst, float((y.float() - ref).abs().max() / ref.abs().max()))
    return worst


def inductor_gemm(
    xq: list[tuple[torch.Tensor, torch.Tensor]], weights: list[Fp8Weight], compiled
) -> None:
    for (q, s), w in zip(xq, weights, strict=True):
        compiled(q, s, w.q, w.scale)


def scaled_mm(q: torch.Tensor, s: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor):
    return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws, out_dtype=torch.bfloat16)


def compile_max_autotune():
    """torch._scaled_mm under inductor's max-autotune, persistent TMA templates allowed; a
    fresh compile per shape (dynamic=False), so each row count is tuned for itself."""
    import torch._inductor.config as inductor

    inductor.triton.enable_persistent_tma_matmul = True
    torch._dynamo.reset()
    return torch.compile(scaled_mm, mode="max-autotune-no-cudagraphs", dynamic=False)


def candidates(rows: int, n: int, k: int, stages: tuple[int, ...] = (4,)) -> list[GemmConfig]:
    """Tiles worth timing for one shape: row blocks up to the rows, and split-K only for
    the narrow outputs (K slices of at least 2 blocks); 128-row tiles at each of `stages`."""
    out = []
    for bm in (16, 32, 64, 128):
        if bm > max(16, rows * 2):
            continue
        for bn in (32, 64, 128, 256) if n <= 4096 else (64, 128, 256):
            for split in (1, 2, 4, 8) if n <= 4096 else (1,):
                if k // (128 * split) < 2 or bm * bn > 128 * 256:
                    continue
                warps = 4 if bm * bn <= 64 * 64 else 8
                for st in stages if bm == 128 else (4,):
                    out.append(GemmConfig(bm, bn, 128, split, warps, st))
    return out


def sweep(args: argparse.Namespace, fp8: list[Fp8Weight], doc: dict) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    for b in (int(r) for r in args.rows.split(",")):
        for i, (k, n) in enumerate(SHAPES):
            ws = fp8[i :: len(SHAPES)]  # this shape's 36 weights
            xq = [quantize_rows(torch.randn(b, k, device=dev, dtype=dt)) for _ in ws]
            ways = {"cublas": functools.partial(fp8_gemm, xq, ws)}
            ways["config_for"] = functools.partial(fp8_served, xq, ws)  # the table, else cuBLASLt
            for cfg in candidates(b, n, k, tuple(int(x) for x in args.stages.split(","))):
                ways[cfg.label()] = functools.partial(fp8_triton, xq, ws, cfg)
            if args.inductor:
                ways["inductor"] = functools.partial(inductor_gemm, xq, ws, compile_max_autotune())
            graphs, failed = {}, {}
            for name, fn in ways.items():
                try:
                    graphs[name] = warm_and_capture(fn, warmups=2)[0]
                except Exception as exc:  # a tile that does not fit: recorded, not fatal
                    failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            times = interleaved_replay_ms(graphs, args.replays)
            med = {name: statistics.median(t) for name, t in times.items()}
            tiles = {
                k2: v for k2, v in med.items() if k2 not in ("cublas", "config_for", "inductor")
            }
            best = min(tiles, key=tiles.__getitem__)
            level = {
                "rows": b, "k": k, "n": n, "median_ms_36": med, "failed": failed,
                "best": best, "best_over_cublas": med[best] / med["cublas"],
                "config_for": getattr(config_for(b, n, k), "label", lambda: "cublas")(),
                "config_for_over_cublas": med["config_for"] / med["cublas"],
            }  # fmt: skip
            if "inductor" in med:  # its answer checked, not taken on trust
                compiled = ways["inductor"].args[2]
                ys = [compiled(q, s, w.q, w.scale) for (q, s), w in zip(xq, ws, strict=True)]
                level["inductor_over_cublas"] = med["inductor"] / med["cublas"]
                level["inductor_worst_error"] = worst_error(ys, xq, ws)
                level["cublas_worst_error"] = worst_error(
                    [scaled_mm(q, s, w.q, w.scale) for (q, s), w in zip(xq, ws, strict=True)],
                    xq, ws,
                )  # fmt: skip
            doc["sweep"].append(level)
            print(
                f"rows {b:4d} k {k:5d} n {n:5d}: cublas {med['cublas']:.3f} ms, best {best} "
                f"{med[best]:.3f} ({level['best_over_cublas']:.3f}x), config_for "
                f"{level['config_for']} {med['config_for']:.3f} "
                f"({level['config_for_over_cublas']:.3f}x), "
                + (
                    f"inductor {med['inductor']:.3f} ({level['inductor_over_cublas']:.3f}x, "
                    f"worst error {level['inductor_worst_error']:.2e} against cuBLASLt's "
                    f"{level['cublas_worst_error']:.2e}), "
                    if "inductor" in med
                    else ""
                )
                + f"{len(failed)} failed",
                flush=True,
            )
            del graphs, xq
        args.out.write_text(json.dumps(doc, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,64,256,512")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="time every candidate tile per shape")
    ap.add_argument("--stages", default="4", help="--sweep: pipeline stages of 128-row tiles")
    ap.add_argument(
        "--inductor", action="store_true", help="--sweep: add inductor's max-autotune GEMM"
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    weights = [
        torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS) for k, n in SHAPES
    ]
    fp8 = [Fp8Weight.of(w) for w in weights]
    env = capture("cuda", "none", dt)
    weight_bytes = {
        "bf16": sum(w.numel() * w.element_size() for w in weights),
        "fp8": sum(w.q.numel() + w.scale.numel() * 4 for w in fp8),
    }
    doc: dict = {
        "environment": env.model_dump(mode="json"),
        "layers": LAYERS,
        "weight_bytes": weight_bytes,
        "levels": [],
        "sweep": [],
    }
    if args.sweep:
        del weights
        sweep(args, fp8, doc)
        return
    for b in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(b, w.shape[1], device=dev, dtype=dt) for w in weights]
        xq = [quantize_rows(x) for x in xs]

        ways = {
            "bf16": functools.partial(bf16, xs, weights),
            "fp8": functools.partial(fp8_full, xs, fp8),
            "fp8_torch_quant": functools.partial(fp8_torch_quant, xs, fp8),
            "fp8_gemm": functools.partial(fp8_gemm, xq, fp8),
        }
        errors = {}
        if b > 1:  # one row: the GEMV's
            ways["fp8_triton"] = functools.partial(fp8_served, xq, fp8)
            ways["fp8_triton_fast"] = functools.partial(fp8_served, xq, fp8, fast=True)
            errors = {  # eagerly, outside the graphs; cuBLASLt's as fp8_gemm
                "fp8_gemm": worst_error(
                    [
                        torch._scaled_mm(q, w.q.t(), scale_a=s, scale_b=w.scale,
                                         out_dtype=torch.bfloat16)
                        for (q, s), w in zip(xq, fp8, strict=True)
                    ],
                    xq, fp8,
                ),
                "fp8_triton": worst_error(fp8_served(xq, fp8), xq, fp8),
                "fp8_triton_fast": worst_error(fp8_served(xq, fp8, fast=True), xq, fp8),
            }  # fmt: skip
        graphs = {name: warm_and_capture(fn, warmups=2)[0] for name, fn in ways.items()}
        times = interleaved_replay_ms(graphs, args.replays)
        med = {name: statistics.median(t) for name, t in times.items()}
        level = {
            "rows": b,
            "median_ms_per_step": med,
            "fp8_over_bf16": med["fp8"] / med["bf16"],
            "fp8_torch_quant_over_bf16": med["fp8_torch_quant"] / med["bf16"],
            "fp8_gemm_over_bf16": med["fp8_gemm"] / med["bf16"],
            "fp8_triton_over_fp8_gemm": med["fp8_triton"] / med["fp8_gemm"] if b > 1 else None,
            "worst_error": errors,
            "read_gb_s": {
                name: weight_bytes["bf16" if name == "bf16" else "fp8"] / (ms * 1e6)
                for name, ms in med.items()
            },
            "replays": args.replays,
        }
        doc["levels"].append(level)
        print(
            f"rows {b:4d}: bf16 {med['bf16']:.3f} ms, fp8 {med['fp8']:.3f} ms "
            f"({level['fp8_over_bf16']:.3f}x; torch's quantization "
            f"{level['fp8_torch_quant_over_bf16']:.3f}x), fp8 GEMM alone {med['fp8_gemm']:.3f} ms "
            f"({level['fp8_gemm_over_bf16']:.3f}x); weights read at "
            f"{level['read_gb_s']['bf16']:.0f} GB/s bf16, {level['read_gb_s']['fp8']:.0f} fp8"
            + (
                f"; triton GEMM {med['fp8_triton']:.3f} ms "
                f"({level['fp8_triton_over_fp8_gemm']:.3f}x cuBLASLt), fast accumulation "
                f"{med['fp8_triton_fast']:.3f}; worst error cuBLASLt/triton/fast "
                + "/".join(
                    f"{errors[k]:.2e}" for k in ("fp8_gemm", "fp8_triton", "fp8_triton_fast")
                )
                if b > 1
                else ""
            ),
            flush=True,
        )
        del graphs, xs, xq
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
