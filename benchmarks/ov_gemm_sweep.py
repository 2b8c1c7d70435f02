"""Time OmniVoice's four packed GEMMs a layer: cuBLAS against small_gemm's split-K configs.

    python benchmarks/ov_gemm_sweep.py --out ov_gemm_sweep.json [--rows 156]

For each weight of techniques/omnivoice/kernels/small_gemm.OV_SHAPES, x [rows, K] bf16 (156:
ov-tput's CFG pair of 78 positions): F.linear (what the packed forward runs, cuBLAS) and
every config below, each checked against the fp32 product first and then timed as CUDA-graph
replays over weight copies that together exceed the L2 four times (each layer's weights
are read from HBM in the real forward). Reports us per call, achieved GB/s over the bytes
moved (weight, x, y) and its fraction of the copy ceiling the environment measures. A
profile for choosing a config, not a headline: a forward's time is `orchestrate run`'s.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from orchestrate.api.device import graph_ms_per_call, l2_copies
from orchestrate.running.environment import capture
from orchestrate.techniques.omnivoice.kernels import small_gemm as sg

CONFIGS = tuple(
    sg.GemmConfig(block_m=bm, block_n=bn, block_k=bk, split_k=s, num_warps=w, num_stages=st)
    for (bm, bn), bk, s, (w, st) in itertools.product(
        ((16, 64), (32, 64), (64, 64), (32, 128), (64, 128)),
        (64, 128),
        (1, 2, 4, 8),
        ((4, 4),),
    )
)


def time_shape(x: torch.Tensor, w: torch.Tensor, ceiling: float) -> tuple[list, list]:
    """Rows (every correct candidate, fastest first) and the configs refused, for one weight."""
    exact = x.float() @ w.float().T
    copies = [w] + [w.clone() for _ in range(l2_copies(w.device, w.numel() * 2) - 1)]
    nbytes = 2 * (w.numel() + x.shape[0] * (w.shape[1] + w.shape[0]))

    def row(label: str, config: dict | None, fn: Callable[[torch.Tensor], torch.Tensor]):
        err = float((fn(w).float() - exact).norm() / exact.norm())
        if err > 1e-2:  # a wrong product is not timed (bf16 rounding is about 3e-3)
            raise ValueError(f"relative error {err:.1e} against the fp32 product")
        us = graph_ms_per_call([lambda c=c: fn(c) for c in copies]) * 1e3
        gb_s = nbytes / us / 1e3
        return {"kernel": label, "config": config, "us": us, "gb_s": gb_s,
                "of_copy": gb_s / ceiling, "rel_err": err}  # fmt: skip

    rows = [row("cublas", None, lambda c: F.linear(x, c))]
    refused = []
    for cfg in CONFIGS:
        try:
            rows.append(row("small_gemm", asdict(cfg), partial(sg.small_gemm, x, config=cfg)))
        except ValueError as e:  # a split this K cannot take, or a wrong product
            refused.append({"config": asdict(cfg), "why": str(e)})
    return sorted(rows, key=lambda r: r["us"]), refused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=156, help="M: 2 x positions (the CFG pair)")
    args = ap.parse_args()
    device = torch.device("cuda")
    env = capture("cuda", "none")  # measures the copy ceiling as the worker does
    ceiling = env.copy_gb_s or float("nan")
    report: dict = {"environment": env.model_dump(mode="json"), "copy_gb_s": ceiling,
                    "rows": args.rows, "shapes": []}  # fmt: skip
    for name, (n, k) in sg.OV_SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(args.rows, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        rows, refused = time_shape(x, w, ceiling)
        cublas = next(r for r in rows if r["kernel"] == "cublas")
        report["shapes"].append({"name": name, "n": n, "k": k, "rows": rows,
                                 "refused": refused})  # fmt: skip
        print(f"\n{name} ({n} x {k}, {args.rows} rows): cuBLAS {cublas['us']:.2f} us "
              f"({cublas['of_copy']:.0%} of copy {ceiling:.0f} GB/s)")  # fmt: skip
        for r in rows[:6]:
            print(f"  {r['us']:7.2f} us {r['of_copy']:5.0%} err {r['rel_err']:.1e} "
                  f"{r['kernel']} {r['config'] or ''}")  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2))  # after each shape: a cut call keeps it


if __name__ == "__main__":
    main()
