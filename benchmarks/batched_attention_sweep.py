"""The batched decode attention kernel's launch options at the serving load (issue 34).

A loaded serving step on an H100 (352 offered streams, about 242 live, FP8 projections and
cache) spent 2.43 ms of its 6.67 busy ms in `_batched_split_kernel`, next to 2.54 ms in the
FP8 GEMMs (benchmarks/h100/serving/serving-profile-cbf16-cev4.json). The kernel's launch is
fixed at 64-position blocks, 4 warps, 3 stages and no splits at that many rows. This sweeps
those options over one layer's shape at the serving mix of lengths and reports achieved
bandwidth against the device's copy ceiling, so the choice is measured, not guessed.

The workload: B rows, each with its own length drawn uniformly (seed 0) from the
prompt-plus-generated range of the serving benchmark (96 to 735 positions), an FP8 (e4m3)
cache with float32 per-position scales as `kv: fp8` keeps it, 16 query heads over 4 KV heads
of 128. Each timed graph calls the kernel once per cache copy, the copies together over 4x
the L2 (as 36 layers' caches would be: no L2 reuse). Rounds interleave the configurations;
each figure is the median over rounds. Every configuration's output is compared with the
shipped configuration's (relative error), and the shipped one with the torch reference.

    python benchmarks/batched_attention_sweep.py --rows 256,512 --out sweep.json

`--kv fp8,int4` times the same launches over a packed INT4 cache too (kernels/int4_cache.py:
half the bytes of keys and values, the same float32 scales; APPROXIMATE), every (cache,
launch) pair interleaved in the same rounds. Both caches are quantized from one bf16 cache
drawn from a normal distribution, and each level records each cache's shipped launch
against attention over that bf16 cache (`rel_err_vs_bf16`): what the 4 bits cost on
Gaussian keys and values, not on a model's.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_bench import environment, write  # the same record fields

from orchestrate.api.device import l2_copies
from orchestrate.techniques.rumik.batched_decode import ATTENTION_BLOCK
from orchestrate.techniques.rumik.fp8_projections import quantize_rows
from orchestrate.techniques.rumik.kernels import batched_attention as ba
from orchestrate.techniques.rumik.kernels.int4_cache import quantize_int4

HQ, HKV, D, S_MAX = 16, 4, 128, 768
LENGTHS = (96, 736)  # uniform in [lo, hi): prompt 95 + up to 640 generated, + 1
# The launch a loaded serving step makes (many rows: unsplit), from its sources
_KERNEL = inspect.signature(ba.batched_decode_attention).parameters
SHIPPED = {
    "block_s": ATTENTION_BLOCK,
    "num_warps": _KERNEL["num_warps"].default,
    "num_stages": _KERNEL["num_stages"].default,
    "num_splits": 1,
}

DEFINITIONS = {
    "us": "microseconds per kernel call: one CUDA graph holding one call per cache copy, "
    "replayed 20 times, CUDA events / (replays x copies); the median over rounds",
    "bytes": "what the call must read and write: every row's valid keys and values (1 byte "
    "each with fp8, half a byte with int4), their float32 scales, q and the output (bf16)",
    "GBps": "bytes / us",
    "of_copy": "GBps / the device-to-device copy's GB/s (read + write) measured in the run",
    "rel_err_vs_shipped": "||out - shipped out|| / ||shipped out|| (float32 norms)",
    "shipped_rel_err_vs_ref": "the shipped launch against batched_decode_attention_ref, "
    "the first 16 rows",
    "rel_err_vs_bf16": "per cache: the shipped launch against the reference over the bf16 "
    "cache both were quantized from, the first 16 rows",
    "int4_over_fp8": "per launch option: the int4 cache's us / the fp8 cache's",
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="256,512", help="batch rows per level, comma-separated")
    ap.add_argument("--block-s", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--splits", default="1,2")
    ap.add_argument("--kv", default="fp8", help="caches: fp8, int4 or both (fp8,int4)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def copy_gbps() -> float:
    """Device-to-device copy of 2 GiB: read + write bytes over the median of 10 copies."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    gbps = 2 * src.numel() / (statistics.median(times[2:]) * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gbps


def operands(rows: int, kvs: list[str]) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """q, lengths, and per cache kind its copies [(k, v, k_scale, v_scale)] and the bytes
    one call moves; with the bf16 cache they were quantized from, under "bf16"."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(*LENGTHS, (rows,), generator=gen, dtype=torch.int32)
    q = torch.randn(rows, HQ, D, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(rows, HKV, S_MAX, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(rows, HKV, S_MAX, D, generator=gen).to("cuda", torch.bfloat16)
    copies, nbytes = {"bf16": [(k, v, None, None)]}, {}
    valid = int(lengths.sum()) * HKV
    for kv in kvs:
        if kv == "fp8":
            (kq, ks), (vq, vs) = quantize_rows(k), quantize_rows(v)
            ks, vs = ks[..., 0].contiguous(), vs[..., 0].contiguous()
        else:
            (kq, ks), (vq, vs) = quantize_int4(k), quantize_int4(v)
        one = 2 * kq.numel() + 2 * ks.numel() * 4
        copies[kv] = [(kq, vq, ks, vs)] + [
            tuple(t.clone() for t in (kq, vq, ks, vs))
            for _ in range(max(4, l2_copies(k.device, one)) - 1)
        ]
        nbytes[kv] = valid * kq.shape[-1] * 2 + valid * 4 * 2 + 2 * rows * HQ * D * 2
    return q, lengths.to("cuda"), copies, nbytes


def capture(q, lengths, copies, out, options: dict[str, int]) -> torch.cuda.CUDAGraph:
    def calls() -> None:
        for k, v, ks, vs in copies:
            ba.batched_decode_attention(q, k, v, lengths, k_scale=ks, v_scale=vs, out=out,
                                        **options)  # fmt: skip

    calls()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, calls: int, replays: int = 20) -> float:
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (replays * calls)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def sweep_rows(
    rows: int, kvs: list[str], configs: list[dict[str, int]], rounds: int, copy: float
) -> dict:
    q, lengths, copies, nbytes = operands(rows, kvs)
    n_ref = 16
    k16, v16 = copies["bf16"][0][:2]
    exact = ba.batched_decode_attention_ref(q[:n_ref], k16[:n_ref], v16[:n_ref],
                                            lengths[:n_ref].tolist())  # fmt: skip
    graphs, errors, checks = [], [], {}
    for kv in kvs:
        k, v, ks, vs = copies[kv][0]
        shipped = ba.batched_decode_attention(q, k, v, lengths, k_scale=ks, v_scale=vs,
                                              **SHIPPED)  # fmt: skip
        ref = ba.batched_decode_attention_ref(
            q[:n_ref], k[:n_ref], v[:n_ref], lengths[:n_ref].tolist(), k_scale=ks[:n_ref],
            v_scale=vs[:n_ref],
        )  # fmt: skip
        checks[kv] = {"shipped_rel_err_vs_ref": rel_err(shipped[:n_ref], ref),
                      "rel_err_vs_bf16": rel_err(shipped[:n_ref], exact)}  # fmt: skip
        for options in configs:
            out = torch.empty_like(q)
            graphs.append((kv, options, capture(q, lengths, copies[kv], out, options)))
            errors.append(rel_err(out, shipped))  # the captured call's warm-up output
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(rounds):  # every (cache, launch) pair once a round
        for i, (kv, _, graph) in enumerate(graphs):
            times[i].append(replay_us(graph, len(copies[kv])))
    results = []
    for (kv, options, _), err, ts in zip(graphs, errors, times, strict=True):
        us = statistics.median(ts)
        gbps = nbytes[kv] / (us * 1e-6) / 1e9
        results.append({"kv": kv, **options, "us": us, "us_rounds": ts, "GBps": gbps,
                        "of_copy": gbps / copy, "rel_err_vs_shipped": err})  # fmt: skip
    if len(kvs) > 1:  # the int4 cache against the fp8 one, launch by launch
        fp8 = {tuple(r[k] for k in SHIPPED): r["us"] for r in results if r["kv"] == "fp8"}
        for r in results:
            if r["kv"] == "int4":
                r["int4_over_fp8"] = r["us"] / fp8[tuple(r[k] for k in SHIPPED)]
    del graphs, copies
    torch.cuda.empty_cache()
    return {
        "rows": rows,
        "lengths_mean": float(lengths.float().mean()),
        "bytes": nbytes,
        "checks": checks,
        "shipped_rel_err_vs_ref": checks[kvs[0]]["shipped_rel_err_vs_ref"],
        "configs": results,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("error: batched_attention_sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = [
        {"block_s": b, "num_warps": w, "num_stages": s, "num_splits": p}
        for b, w, s, p in itertools.product(
            ints(args.block_s), ints(args.warps), ints(args.stages), ints(args.splits)
        )
    ]
    if SHIPPED not in configs:
        configs.insert(0, dict(SHIPPED))
    kvs = [kv for kv in args.kv.split(",") if kv]
    if not kvs or set(kvs) - {"fp8", "int4"} or len(set(kvs)) != len(kvs):
        print(f"error: --kv {args.kv!r}: fp8, int4 or fp8,int4", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    copy = copy_gbps()
    doc: dict[str, Any] = {
        "issue": 34,
        "what": __doc__.split("\n\n")[0],
        "environment": environment("cuda"),
        "shape": {
            "hq": HQ,
            "hkv": HKV,
            "head_dim": D,
            "cache_positions": S_MAX,
            "lengths": f"uniform in [{LENGTHS[0]}, {LENGTHS[1]}), seed 0",
            "cache": {
                "fp8": "e4m3 with float32 per-position scales (quantize_rows)",
                "int4": "packed int4, two a byte, float32 per-position scales (quantize_int4)",
            },
            "values": "q, keys and values standard normal (bf16), the caches quantized from it",
        },
        "shipped": SHIPPED,
        "copy_GBps": copy,
        "definitions": DEFINITIONS,
        "levels": [],
    }
    for rows in ints(args.rows):
        level = sweep_rows(rows, kvs, configs, args.rounds, copy)
        doc["levels"].append(level)
        doc["elapsed_s"] = time.perf_counter() - t0
        write(Path(args.out), doc)  # each level as it ends: a time limit keeps the others
        for kv in kvs:
            mine = [c for c in level["configs"] if c["kv"] == kv]
            base = next(c for c in mine if all(c[k] == SHIPPED[k] for k in SHIPPED))
            check = level["checks"][kv]
            print(f"rows {rows} {kv} (mean length {level['lengths_mean']:.0f}), copy "
                  f"{copy:.0f} GB/s, shipped vs ref {check['shipped_rel_err_vs_ref']:.2e}, "
                  f"vs the bf16 cache {check['rel_err_vs_bf16']:.2e}")  # fmt: skip
            for c in [*sorted(mine, key=lambda c: c["us"])[:6], base]:
                vs_fp8 = f", {c['int4_over_fp8']:.3f}x fp8's" if "int4_over_fp8" in c else ""
                print(f"  block_s {c['block_s']:3} warps {c['num_warps']} stages "
                      f"{c['num_stages']} splits {c['num_splits']}: {c['us']:7.1f} us "
                      f"{c['GBps']:6.0f} GB/s ({c['of_copy']:.2f} of copy) "
                      f"x{base['us'] / c['us']:.3f} vs shipped{vs_fp8}, "
                      f"err {c['rel_err_vs_shipped']:.1e}")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
