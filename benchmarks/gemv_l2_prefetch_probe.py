"""Measure before building: would prefetching the output GEMV's weights into the L2 pay?

    python benchmarks/gemv_l2_prefetch_probe.py --out probe.json [--glue-us 12]

exp74-full's layer streams two INT8 weights: 51.4 MB for q|k|v|gate|up (over the H200's
L2) and 26.7 MB for o|down (under it). Between the two GEMVs about 12 us of glue (rotary +
cache write, attention split and merge, SwiGLU + pack) leave HBM idle. If a kernel on a
side stream pulled the o|down weight into the L2 during that glue, the GEMV after it would
read from the L2. This probe times, over weight copies that together exceed the L2 four
times (each layer's weights come from HBM, as in a step), in CUDA-graph replays:
  * the o|down GEMV from HBM (cold) and from the L2 (the same copy every call: warm);
  * the prefetch kernel alone (loads with evict_last, nothing kept in registers);
  * a layer's tail as it runs today: a stand-in for the glue (a one-block spin kernel of
    --glue-us, leaving the SMs and HBM free), then the GEMV; and the same with the prefetch
    forked onto a side stream at the glue's start and joined before the GEMV.
The difference of the last two, per layer, times 36 layers, is what the technique could
save a token. A probe for choosing the next technique, not a headline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from orchestrate.api.device import graph_ms_per_call, l2_copies
from orchestrate.running.environment import capture
from orchestrate.techniques.rumik.kernels import int8_gemv as g


@triton.jit
def _prefetch_kernel(ptr, n, sink_ptr, BLOCK: tl.constexpr):
    """Every word of [ptr, ptr + n) loaded once with evict_last; a sum nobody reads is stored
    only if it hits an unlikely value, so the loads are not optimised away."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        word = tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
        acc = tl.maximum(acc, word)
    total = tl.max(acc, axis=0)
    if total == -2147483647:
        tl.store(sink_ptr, total)


def prefetch(w: torch.Tensor, sink: torch.Tensor, programs: int, block: int = 2048) -> None:
    """w read as int32 words (its bytes a multiple of 16: 16-byte vector loads)."""
    words = w.view(-1).view(torch.int32)
    _prefetch_kernel[(programs,)](words, words.numel(), sink, BLOCK=block, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--glue-us", type=float, default=12.0)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=13056)
    args = ap.parse_args()
    env = capture("cuda", "none")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    q, scale = g.quantize_int8(torch.randn(args.n, args.k, device=dev, dtype=torch.bfloat16))
    x = torch.randn(1, args.k, device=dev, dtype=torch.bfloat16)
    copies = [q] + [q.clone() for _ in range(l2_copies(dev, q.numel()) - 1)]
    out = torch.empty(1, args.n, device=dev, dtype=torch.bfloat16)
    sink = torch.zeros(1, device=dev, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cycles = int(args.glue_us * 1980)  # at the H200's 1980 MHz; glue_alone_us is the measure
    side = torch.cuda.Stream()

    def gemv(c: torch.Tensor) -> None:
        g.int8_linear(x, c, scale, out=out)

    def tail(c: torch.Tensor, with_prefetch: bool, programs: int) -> None:
        main_stream = torch.cuda.current_stream()
        if with_prefetch:
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                prefetch(c, sink, programs)
        torch.cuda._sleep(cycles)  # the glue's stand-in: one block spinning
        if with_prefetch:
            main_stream.wait_stream(side)
        gemv(c)

    rows: dict[str, float] = {
        "gemv_cold_us": graph_ms_per_call([lambda c=c: gemv(c) for c in copies]) * 1e3,
        "gemv_warm_us": graph_ms_per_call([lambda: gemv(q)] * len(copies)) * 1e3,
        "glue_alone_us": graph_ms_per_call([lambda: torch.cuda._sleep(cycles)] * 8) * 1e3,
        "tail_today_us": graph_ms_per_call([lambda c=c: tail(c, False, 0) for c in copies]) * 1e3,
    }
    for programs in (sms, 2 * sms, 4 * sms):
        rows[f"prefetch_alone_{programs}_us"] = graph_ms_per_call(
            [lambda c=c, p=programs: prefetch(c, sink, p) for c in copies]) * 1e3  # fmt: skip
        rows[f"tail_prefetched_{programs}_us"] = graph_ms_per_call(
            [lambda c=c, p=programs: tail(c, True, p) for c in copies]) * 1e3  # fmt: skip
    best = min(v for k, v in rows.items() if k.startswith("tail_prefetched"))
    rows["saved_per_layer_us"] = rows["tail_today_us"] - best
    rows["saved_per_token_ms_36_layers"] = rows["saved_per_layer_us"] * 36 / 1e3
    mb = q.numel() / 1e6
    report = {"environment": env.model_dump(mode="json"), "weight_mb": mb, "n": args.n,
              "k": args.k, "glue_us": args.glue_us, "sleep_cycles": cycles,
              "rows": rows}  # fmt: skip
    for k, v in rows.items():
        print(f"{k:36s} {v:9.3f}")
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
