"""Time OmniVoice's fused q/k/v norm + rotary kernel per num_warps and layout.

    python benchmarks/ov_qkv_warps.py --out ov_qkv_warps.json

The packed forward launches `qkv_norm_rope` once a layer on [2, 78, 4096] bf16 (ov-tput's CFG
pair; Qwen3's 16 query and 8 KV heads of 128) with num_warps=4. One profile
(benchmarks/h200/issue14-ov-qkv-v5-profile.json) timed it at 3.34 us heads-major (v3) and
3.88 us tokens-major (v5): this sweep asks whether another warp count suits the tokens-major
writes. Each launch is compared with the shipped one (the
norm's sums reduce across warps, so another count may round differently: said per row), then
timed as CUDA-graph replays over input copies beyond the L2. A profile for choosing a launch
shape, not a headline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from orchestrate.api.device import graph_ms_per_call, l2_copies
from orchestrate.running.environment import capture
from orchestrate.techniques.omnivoice.kernels import qk_norm_rope as qkr

B, S, HQ, HKV, D = 2, 78, 16, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    env = capture("cuda", "none")
    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    qkv = torch.randn(B, S, (HQ + 2 * HKV) * D, device=dev, dtype=bf16)
    qw, kw = (torch.randn(D, device=dev, dtype=bf16) for _ in range(2))
    ang = torch.rand(1, S, D // 2, device=dev) * 6.0
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(bf16).contiguous()
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(bf16).contiguous()
    copies = [qkv] + [qkv.clone() for _ in range(l2_copies(dev, qkv.numel() * 2) - 1)]
    rows = []
    for tokens_major in (True, False):

        def launch(x: torch.Tensor, warps: int, tm: bool = tokens_major):
            return qkr.qkv_norm_rope(x, qw, kw, cos, sin, 1e-6, HQ, HKV, tm, num_warps=warps)

        shipped = launch(qkv, 4)
        for warps in (1, 2, 4, 8, 16):
            # the norm's sums reduce across warps: another count may round differently
            got = launch(qkv, warps)
            pairs = list(zip(got, shipped, strict=True))
            equal = all(torch.equal(a, b) for a, b in pairs)
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
            us = graph_ms_per_call([lambda c=c, w=warps: launch(c, w) for c in copies]) * 1e3
            rows.append({"tokens_major": tokens_major, "num_warps": warps, "us": us,
                         "equal_to_4_warps": equal, "max_abs_diff": diff})  # fmt: skip
            print(f"{'tokens-major' if tokens_major else 'heads-major':12s} "
                  f"num_warps={warps:2d}: {us:6.2f} us  equal to 4 warps: {equal} "
                  f"(max diff {diff:.3g})")  # fmt: skip
    report = {"environment": env.model_dump(mode="json"), "shape": [B, S, HQ, HKV, D],
              "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
