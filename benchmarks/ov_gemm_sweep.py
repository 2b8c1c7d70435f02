"""Time OmniVoice's four packed GEMMs a layer: cuBLAS against small_gemm's split-K configs.

    python benchmarks/ov_gemm_sweep.py --out ov_gemm_sweep.json [--rows 156]
        [--stack-out benchmarks/stacks/ov-best-packed-gemm.yaml --min-gain 1.05]

For each weight of techniques/omnivoice/kernels/small_gemm.OV_SHAPES, x [rows, K] bf16 (156:
ov-tput's CFG pair of 78 positions): F.linear (what the packed forward runs, cuBLAS), F.linear
through cuBLASLt (preferred_blas_library) and every config below, each checked against the
fp32 product first and then timed as CUDA-graph replays over weight copies that together
exceed the L2 four times (each layer's weights are read from HBM in the real forward).
Reports us per call, achieved GB/s over the bytes moved (weight, x, y) and its fraction of
the copy ceiling the environment measures. A profile for choosing a config, not a
headline: a forward's time is `orchestrate run`'s.

--stack-out writes the base stack (ov-best-packed-qkv) with ov_packed_projections'
`small_gemm` set for each shape whose fastest config beats cuBLAS by --min-gain or more,
for the A/B that decides (nothing is written when no shape does).
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
        ((4, 4), (8, 3), (2, 3), (4, 2)),  # (num_warps, num_stages)
    )
)


def blas(library: str, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """F.linear through one cuBLAS front end (torch.backends.cuda.preferred_blas_library)."""

    def linear(w: torch.Tensor) -> torch.Tensor:
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return F.linear(x, w)
        finally:
            torch.backends.cuda.preferred_blas_library(before)

    return linear


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

    rows = [
        row("cublas", None, lambda c: F.linear(x, c)),  # what the forward runs
        row("cublaslt", None, blas("cublaslt", x)),
    ]
    refused = []
    for cfg in CONFIGS:
        try:
            rows.append(row("small_gemm", asdict(cfg), partial(sg.small_gemm, x, config=cfg)))
        except ValueError as e:  # a split this K cannot take, or a wrong product
            refused.append({"config": asdict(cfg), "why": str(e)})
    return sorted(rows, key=lambda r: r["us"]), refused


def write_stack(report: dict, base: Path, out: Path, min_gain: float) -> None:
    """The base stack with small_gemm where the sweep says it wins, or nothing (said)."""
    import yaml

    chosen, why = {}, []
    for shape in report["shapes"]:
        cublas = next(r for r in shape["rows"] if r["kernel"] == "cublas")
        best = next((r for r in shape["rows"] if r["kernel"] == "small_gemm"), None)
        if best is not None and cublas["us"] / best["us"] >= min_gain:
            chosen[shape["name"]] = best["config"]
            why.append(f"{shape['name']} {cublas['us']:.2f} -> {best['us']:.2f} us")
    if not chosen:
        print(f"\nno shape's best config beats cuBLAS by {min_gain}x: no stack written")
        return
    stack = yaml.safe_load(base.read_text())
    packed = next(t for t in stack["techniques"] if t["name"] == "ov_packed_projections")
    packed.setdefault("params", {})["small_gemm"] = chosen
    stack["name"] = out.stem
    stack["description"] = (
        f"{stack['name']} = {base.stem} with small_gemm where benchmarks/ov_gemm_sweep.py "
        f"timed a config {min_gain}x or more faster than cuBLAS at {report['rows']} rows "
        f"(CUDA-graph replay, weights beyond the L2): {'; '.join(why)}. "
        f"{report['environment'].get('device_name')}, code {report['environment'].get('git_sha')}."
    )
    out.write_text(yaml.safe_dump(stack, sort_keys=False, width=92))
    print(f"\nwrote {out}: small_gemm for {', '.join(chosen)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=156, help="M: 2 x positions (the CFG pair)")
    ap.add_argument("--stack-out", type=Path, help="write the winners' stack here")
    ap.add_argument("--base-stack", type=Path,
                    default=Path("benchmarks/stacks/ov-best-packed-qkv.yaml"))  # fmt: skip
    ap.add_argument("--min-gain", type=float, default=1.05,
                    help="cuBLAS us / config us a shape needs to take small_gemm")  # fmt: skip
    args = ap.parse_args()
    device = torch.device("cuda")
    env = capture("cuda", "none")  # measures the copy ceiling as the worker does
    ceiling = env.copy_gb_s or float("nan")
    report: dict = {"environment": env.model_dump(mode="json"), "copy_gb_s": ceiling,
                    "rows": args.rows, "shapes": [],
                    "default_blas": str(torch.backends.cuda.preferred_blas_library())}  # fmt: skip
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
        for r in rows[:6] + [r for r in rows[6:] if r["kernel"] == "cublaslt"]:
            print(f"  {r['us']:7.2f} us {r['of_copy']:5.0%} err {r['rel_err']:.1e} "
                  f"{r['kernel']} {r['config'] or ''}")  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2))  # after each shape: a cut call keeps it
    if args.stack_out:
        write_stack(report, args.base_stack, args.stack_out, args.min_gain)


if __name__ == "__main__":
    main()
