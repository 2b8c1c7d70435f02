"""Sweep INT8 GEMV launch configs at the two decode shapes of Rumik OSS 1 on the GPU.

    python benchmarks/gemv_sweep.py --out gemv_sweep.json

For (25088 x 2048) (q,k,v,gate,up packed) and (2048 x 13056) (o+down packed): every config
of int8_gemv.GEMV_CONFIGS plus the wider candidates below, each timed by tune_int8_linear
(CUDA-graph replay over weight copies that exceed the L2 four times), against the shipped
H200 winner, with achieved bandwidth and its fraction of the copy ceiling the environment
measures (benchmarks/h200/issue14-gemv-sweep.json and issue14-gemv-sweep-refined.json used
a 1 GiB copy of this script's own: 4.23-4.24 TB/s). A profile for choosing H200_CONFIGS, not
a headline: the step's time is `orchestrate run`'s. `--tma` times only the shipped config,
the pdl_tuned table's and the TMA kernel's candidates; `--repeats N` sweeps N times and reports
each config's median.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from orchestrate.running.environment import capture
from orchestrate.techniques.rumik.kernels import int8_gemv as g

SHAPES = ((25088, 2048), (2048, 13056))
C = g.GemvConfig
EXTRA = (  # more bytes in flight per program, or more programs for the short-N shape
    C(32, 256, 8, magic=True),
    C(16, 512, 8, magic=True),
    C(32, 256, 8, prefetch=True, magic=True),
    C(8, 256, 4, magic=True),
    C(32, 128, 4, magic=True),
    C(8, 1024, 4, split_k=2, prefetch=True, magic=True),
    C(4, 1024, 4, split_k=2, prefetch=True, magic=True),
    C(4, 1024, 4, split_k=4, prefetch=True, magic=True),
    C(16, 512, 8, split_k=2, prefetch=True, magic=True),
    C(8, 512, 4, split_k=2, prefetch=True, magic=True),
    C(16, 1024, 8, prefetch=True, magic=True),
    C(8, 2048, 8, magic=True),
    # around the first sweep's winners (benchmarks/h200/issue14-gemv-sweep-refined.json)
    C(16, 512, 8, prefetch=True, magic=True),
    C(32, 512, 8, magic=True),
    C(16, 1024, 8, magic=True),
    C(8, 1024, 8, magic=True),
    C(16, 512, 16, magic=True),
    C(4, 2048, 8, magic=True),
    C(8, 4096, 8, magic=True),
    C(4, 4096, 8, magic=True),
    C(16, 2048, 8, magic=True),
    C(8, 2048, 16, magic=True),
    C(4, 2048, 4, magic=True),
    C(8, 2048, 8, split_k=2, magic=True),
    # the first chunk before the PDL wait (preload), and a [BLOCK_N] accumulator (reduce_each)
    # that frees registers for wider chunks and more programs (timed with PDL:
    # benchmarks/h200/issue14-gemv-sweep-pdl.json)
    C(16, 512, 8, magic=True, preload=True),
    C(16, 512, 8, magic=True, reduce_each=True),
    C(16, 512, 8, magic=True, preload=True, reduce_each=True),
    C(16, 1024, 8, magic=True, preload=True, reduce_each=True),
    C(16, 2048, 8, magic=True, preload=True, reduce_each=True),
    C(32, 1024, 8, magic=True, preload=True, reduce_each=True),
    C(16, 2048, 16, magic=True, preload=True, reduce_each=True),
    C(8, 2048, 8, magic=True, preload=True),
    C(8, 2048, 8, magic=True, preload=True, reduce_each=True),
    C(8, 4096, 8, magic=True, preload=True, reduce_each=True),
    C(4, 2048, 4, magic=True, preload=True, reduce_each=True),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pdl", action="store_true",
                    help="launch every call with PDL: each overlaps the previous one's tail, "
                    "as inside a decode step (where preload can pay)")  # fmt: skip
    ap.add_argument("--tma", action="store_true",
                    help="time only the shipped config, the pdl_tuned table's and the TMA kernel's "
                    "candidates (int8_gemv.TMA_CONFIGS)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1,
                    help="sweep every config this many times, interleaved; rows report the "
                    "median (and every pass)")  # fmt: skip
    args = ap.parse_args()
    device = torch.device("cuda")
    env = capture("cuda", "none")  # measures the copy ceiling as the worker does
    ceiling = env.copy_gb_s or float("nan")
    report: dict = {"environment": env.model_dump(mode="json"), "copy_gb_s": ceiling,
                    "pdl": args.pdl, "shapes": []}  # fmt: skip
    for n, k in SHAPES:
        torch.manual_seed(0)
        q, scale = g.quantize_int8(torch.randn(n, k, device=device, dtype=torch.bfloat16))
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        shipped = g.default_config(n, k)
        configs, refused = [], []
        if args.tma:
            tuned = g.GEMV_TABLES["pdl_tuned"].get((n, k))
            candidates = (shipped, *([tuned] if tuned else []), *g.TMA_CONFIGS[(n, k)])
        else:
            candidates = (shipped, *g.GEMV_CONFIGS, *EXTRA, *g.TMA_CONFIGS.get((n, k), ()))
        for cfg in dict.fromkeys(candidates):
            try:  # every candidate computes the same product before it is timed
                out = g.int8_linear(x, q, scale, config=cfg)
            except ValueError as e:  # a config this shape cannot take (the launcher says why)
                refused.append({"config": asdict(cfg), "why": str(e)})
                continue
            ref = g.int8_linear_ref(x, q, scale).float()
            err = (out.float() - ref).norm() / ref.norm()
            assert float(err) < 1e-2, (cfg, float(err))
            configs.append(cfg)
        passes = [g.tune_int8_linear(x, q, scale, configs, launch_pdl=args.pdl)[1]
                  for _ in range(max(1, args.repeats))]  # fmt: skip
        times = {c: statistics.median(p[c] for p in passes) for c in configs}
        best = min(times, key=times.__getitem__)
        nbytes = q.numel() + scale.numel() * scale.element_size() + 2 * (k + n)
        rows = [
            {"config": asdict(c), "us": t * 1e3, "us_passes": [p[c] * 1e3 for p in passes],
             "gb_s": nbytes / (t / 1e3) / 1e9, "of_copy": nbytes / (t / 1e3) / 1e9 / ceiling,
             "shipped": c == shipped}
            for c, t in sorted(times.items(), key=lambda kv: kv[1])
        ]  # fmt: skip
        report["shapes"].append({"n": n, "k": k, "bytes": nbytes, "rows": rows, "refused": refused})
        frac = nbytes / times[best] / 1e6 / ceiling
        print(f"\n{n} x {k}: shipped {times[shipped] * 1e3:.2f} us, best "
              f"{times[best] * 1e3:.2f} us ({frac:.0%} of copy {ceiling:.0f} GB/s)")  # fmt: skip
        for r in rows[:6]:
            print(f"  {r['us']:7.2f} us {r['of_copy']:5.0%} {r['config']}")
        args.out.write_text(json.dumps(report, indent=2))  # after each shape: a cut call keeps it


if __name__ == "__main__":
    main()
