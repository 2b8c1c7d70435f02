"""Measure before building: would FP8 GEMMs or another attention kernel shorten OmniVoice's forward?

    python benchmarks/ov_probe_fp8_attn.py --out ov_probe.json [--rows 156 --seq 78]

The profile of ov-best-packed-qkv's forward (1.429 GPU-busy ms,
benchmarks/h200/issue14-ov-qkv-v5-profile.json): cuBLAS's four bf16 GEMMs a layer 52% (each at
about a quarter of the copy bandwidth at 156 rows), cuDNN's attention 0.188 ms (6.7 us a
layer at 2 x 78 positions). Two levers no stack has tried:
  * FP8 weights and activations (e4m3, a scale per row of each: torch._scaled_mm, cuBLASLt):
    half the weight bytes and twice the tensor rate. Timed with the activations already
    quantized and, separately, the activation quantization a forward would add (one compiled
    kernel per GEMM input unless fused into the norm before it). APPROXIMATE: a stack built
    on it would go through the quality gates.
  * The other SDPA back ends at the forward's attention shape (the CFG pair as batch 2, 16
    heads of 128, a key-padding mask on the unconditional row as the packed forward passes).
GEMMs are timed as CUDA-graph replays over weight copies that together exceed the L2 four
times; attention over one set of q/k/v (it is not weight-bound). A probe for choosing the
next technique, not a headline: a forward's time is `orchestrate run`'s.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from orchestrate.api.device import graph_ms_per_call, l2_copies
from orchestrate.running.environment import capture

SHAPES = {
    "qkv": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
}  # fmt: skip  (small_gemm.OV_SHAPES: [N, K] per layer)
FP8 = torch.float8_e4m3fn


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one fp32 scale per row (amax / 448)."""
    amax = t.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / torch.finfo(FP8).max
    return (t.float() / scale).to(FP8), scale


def gemm_row(rows: int, name: str, n: int, k: int) -> dict:
    """One GEMM shape: bf16 cuBLAS, FP8 _scaled_mm, and FP8 with the activation quantization."""
    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    exact = x.float() @ w.float().T
    wq, ws = rowwise_fp8(w)
    xq, xs = rowwise_fp8(x)
    copies = l2_copies(w.device, w.numel() * 2)
    bf16_w = [w] + [w.clone() for _ in range(copies - 1)]
    fp8_w = [wq] + [wq.clone() for _ in range(copies - 1)]
    quant = torch.compile(rowwise_fp8, dynamic=False)

    def fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(a, b.T, scale_a=a_scale, scale_b=ws.T, out_dtype=torch.bfloat16)

    def rel(y: torch.Tensor) -> float:
        return float((y.float() - exact).norm() / exact.norm())

    row: dict = {"gemm": name, "rows": rows, "n": n, "k": k, "bf16_rel_err": rel(F.linear(x, w))}
    row["bf16_us"] = graph_ms_per_call([partial(F.linear, x, c) for c in bf16_w]) * 1e3
    try:
        row["fp8_rel_err"] = rel(fp8_mm(xq, xs, wq))
    except RuntimeError as e:  # e.g. a row count _scaled_mm refuses
        row["fp8_error"] = str(e).splitlines()[0][:200]
        return row
    row["fp8_us"] = graph_ms_per_call([partial(fp8_mm, xq, xs, c) for c in fp8_w]) * 1e3
    with_quant = [lambda c=c: fp8_mm(*quant(x), c) for c in fp8_w]
    row["fp8_with_quant_us"] = graph_ms_per_call(with_quant) * 1e3
    row["quant_alone_us"] = graph_ms_per_call([partial(quant, x)] * 8) * 1e3
    return row


def gemm_rows(rows: int) -> list[dict]:
    out = []
    for name, (n, k) in SHAPES.items():
        out.append(gemm_row(rows, name, n, k))
        print(json.dumps(out[-1]))
    return out


def attention_rows(seq: int, pad: int) -> list[dict]:
    """[2, 16, seq, 128] q/k/v; the second row's last `pad` keys masked (the uncond padding)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, seq, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    mask = torch.ones(2, 1, seq, seq, dtype=torch.bool, device="cuda")
    mask[1, :, :, seq - pad :] = False
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    rows = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):  # fmt: skip
        for masked in (True, False):
            m = mask if masked else None
            row: dict = {"backend": backend.name, "mask": masked, "seq": seq}
            try:
                with sdpa_kernel(backend):
                    y = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
                    if masked:
                        row["rel_err"] = float((y.float() - exact).norm() / exact.norm())
                    row["us"] = (
                        graph_ms_per_call(
                            [lambda m=m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)] * 8
                        )
                        * 1e3
                    )
            except RuntimeError as e:
                row["error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            print(json.dumps(row))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[156, 160],
        help="GEMM rows: 156 is ov-tput's CFG pair of 78; 160 the next multiple of 16",
    )
    ap.add_argument("--seq", type=int, default=78)
    ap.add_argument("--pad", type=int, default=23, help="masked keys on the unconditional row")
    args = ap.parse_args()
    env = capture("cuda", "none")
    report = {"environment": env.model_dump(mode="json"),
              "gemms": [r for rows in args.rows for r in gemm_rows(rows)],
              "attention": attention_rows(args.seq, args.pad)}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
