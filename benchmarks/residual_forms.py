"""The batched decoder's output projections, two ways, at the Rumik shape (issue 34):

  packed:     x + linear(cat([attn, act]), cat([o_proj, down_proj], 1))   (a 1.9 GB copy)
  accumulate: addmm(addmm(x, attn, o_proj.T), act, down_proj.T)           (the model's own)

    python benchmarks/residual_forms.py --rows 1,32,128,256,512 --out residual.json

Per row count, each form runs 36 times (one per layer, distinct weights, as a step does) in
one CUDA graph; the graphs replay interleaved, and each replay is timed by CUDA events. The
JSON gives the median ms per step (36 layers) of each form and their ratio, unrounded, with
the GPU, versions and git SHA. Also checks the two forms agree (max |diff| / max |y|).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from orchestrate.api.device import interleaved_replay_ms
from orchestrate.running.environment import capture
from orchestrate.techniques.rumik.cuda_graph import warm_and_capture

LAYERS, HIDDEN, ATTN, INTER = 36, 2048, 2048, 11008


def packed(x, attn, act, w_cat) -> torch.Tensor:
    y = x
    for w in w_cat:
        y = y + F.linear(torch.cat([attn, act], -1), w)
    return y


def accumulate(x, attn, act, w_o, w_d) -> torch.Tensor:
    y = x
    for o, d in zip(w_o, w_d, strict=True):
        y = torch.addmm(torch.addmm(y, attn, o.t()), act, d.t())
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,32,128,256,512")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w_o = [torch.randn(HIDDEN, ATTN, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    w_d = [torch.randn(HIDDEN, INTER, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    w_cat = [torch.cat([o, d], 1) for o, d in zip(w_o, w_d, strict=True)]
    env = capture("cuda", "none", dt)
    doc: dict = {"environment": env.model_dump(mode="json"), "layers": LAYERS, "levels": []}
    for b in (int(r) for r in args.rows.split(",")):
        x = torch.randn(b, HIDDEN, device=dev, dtype=dt)
        attn = torch.randn(b, ATTN, device=dev, dtype=dt)
        act = torch.randn(b, INTER, device=dev, dtype=dt)
        forms = {
            "packed": functools.partial(packed, x, attn, act, w_cat),
            "accumulate": functools.partial(accumulate, x, attn, act, w_o, w_d),
        }
        graphs, outs = {}, {}
        for name, fn in forms.items():
            graphs[name], outs[name] = warm_and_capture(fn, warmups=3)
        times = interleaved_replay_ms(graphs, args.replays)
        ref = outs["packed"].float()
        diff = (outs["accumulate"].float() - ref).abs().max() / ref.abs().max()
        med = {name: statistics.median(t) for name, t in times.items()}
        level = {
            "rows": b,
            "median_ms_per_step": med,
            "accumulate_over_packed": med["accumulate"] / med["packed"],
            "max_abs_diff_over_max_abs": float(diff),
            "replays": args.replays,
        }
        doc["levels"].append(level)
        print(
            f"rows {b:4d}: packed {med['packed']:.3f} ms, accumulate {med['accumulate']:.3f} ms"
            f" ({level['accumulate_over_packed']:.3f}x), rel diff {float(diff):.2e}",
            flush=True,
        )
        del graphs, outs
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
