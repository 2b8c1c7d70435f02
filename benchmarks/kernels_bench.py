"""H200 benchmark of the Rumik decode kernels (techniques/rumik/kernels) at the real shapes.

For each kernel: check it against its torch reference on the GPU, then time it against the
baseline it replaces, and count the bytes it must move to give achieved GB/s against the
device-to-device copy ceiling measured first.

- INT8 GEMV vs cuBLAS bf16 F.linear (M=1) for the five decode projections, plus the whole
  36-layer projection stack captured in one CUDA graph (int8 vs bf16, with and without PDL).
- INT6 GEMV (4 weights in 3 bytes) vs the INT8 GEMV on the same weights, per shape (shipped
  heuristic and tuned) and as the 36-layer stack: fewer bytes, more unpacking; which wins?
- Decode attention vs torch SDPA (enable_gqa) on the valid slice, and vs SDPA over the whole
  static cache with a mask (what a fixed-shape graph has to do without a device length).
- Sampler vs torch topk -> softmax -> multinomial.
- LayerNorm (+ residual add) and rotary + cache write vs eager torch.

Every timing is CUDA events over CUDA-graph replays, per call, with the launch gaps a graph
keeps: the Python wrappers cost tens of microseconds of host time per call, more than most of
these kernels, so eager timings (do_bench included) would measure the host. Each graph calls
the op over operand copies (weights, KV caches) that together exceed the L2, so bytes come
from HBM as in decode. No network; about 2-3 minutes on an H200.

    python benchmarks/kernels_bench.py --out results/kernels_h200.json [--no-tune]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton

from orchestrate.api.device import graph_ms_per_call, l2_copies
from orchestrate.techniques.rumik.kernels import decode_attention as attn
from orchestrate.techniques.rumik.kernels import int6_gemv as g6
from orchestrate.techniques.rumik.kernels import int8_gemv as gemv
from orchestrate.techniques.rumik.kernels import rope_norm as rn
from orchestrate.techniques.rumik.kernels import sampler as samp

DEV = torch.device("cuda:0")  # str(DEV) must match tensors' device keys (tuning cache)
BF16 = torch.bfloat16
HIDDEN, LAYERS, HQ, HKV, D = 2048, 36, 16, 4, 128
GEMV_SHAPES = [  # (N, K, what)
    (25088, 2048, "qkv+gate+up packed"),
    (2048, 13056, "o+down packed"),
    (2048, 2048, "o_proj"),
    (11008, 2048, "gate/up"),
    (2048, 11008, "down_proj"),
]
ROWS: list[dict[str, Any]] = []  # the printed table


def graph_ms(fn: Callable[[], object], replays: int = 20) -> float:
    """Per-replay time of one CUDA graph holding everything fn launches."""
    return graph_ms_per_call([fn], replays)


def copies_of(t: torch.Tensor, nbytes: int | None = None) -> list[torch.Tensor]:
    """t plus clones, together over 4x the L2 (counting nbytes of traffic per copy)."""
    n = l2_copies(t.device, nbytes or t.numel() * t.element_size())
    return [t] + [t.clone() for _ in range(n - 1)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def row(kernel: str, shape: str, ms: float, base_ms: float | None, nbytes: float) -> None:
    ROWS.append({"kernel": kernel, "shape": shape, "us": ms * 1e3,
                 "base_us": None if base_ms is None else base_ms * 1e3,
                 "GBps": gbps(nbytes, ms) if nbytes else None})  # fmt: skip


# --------------------------------------------------------------------------- ceiling


def copy_bandwidth() -> dict[str, float]:
    """Device-to-device copy of 4 GiB: 8.6 GB moved (read + write)."""
    n = 4 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 10
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": 2.0 * n, "ms": ms, "GBps": gbps(2.0 * n, ms)}


# --------------------------------------------------------------------------- GEMV


def bench_gemv(tune: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"shapes": [], "tuning": {}}
    for n, k, what in GEMV_SHAPES:
        w = torch.randn(n, k, device=DEV, dtype=BF16) * 0.02
        q, scale = gemv.quantize_int8(w)
        x = torch.randn(1, k, device=DEV, dtype=BF16)
        if tune:
            best, times = gemv.tune_int8_linear(x, q, scale)
            ranked = sorted(times.items(), key=lambda i: i[1])
            out["tuning"][f"{n}x{k}"] = [vars(c) | {"ms": t} for c, t in ranked]
            print(f"  tuned {n}x{k}: {best} {times[best] * 1e3:.1f} us", flush=True)
        cfg = gemv._TUNED.get((str(DEV), True, n, k)) or gemv.default_config(n, k)
        y = gemv.int8_linear(x, q, scale, config=cfg)
        x4 = torch.randn(4, k, device=DEV, dtype=BF16)
        errs = {
            "rel_err_vs_ref": rel_err(y, gemv.int8_linear_ref(x, q, scale)),
            "rel_err_vs_bf16_weights": rel_err(y, F.linear(x, w)),
            "rel_err_pdl_vs_plain": rel_err(gemv.int8_linear(x, q, scale, launch_pdl=True), y),
            "m4_rel_err": rel_err(gemv.int8_linear(x4, q, scale),
                                  gemv.int8_linear_ref(x4, q, scale)),
        }  # fmt: skip
        timing = _time_gemv(x, x4, copies_of(q), copies_of(w), scale, cfg)
        b8 = n * k + n * scale.element_size() + 2 * k + 2 * n
        b16 = 2 * n * k + 2 * k + 2 * n
        ms, base = timing["int8_ms"], timing["bf16_ms"]
        out["shapes"].append({"N": n, "K": k, "what": what, "config": vars(cfg), **errs,
                              **timing, "int8_GBps": gbps(b8, ms), "bf16_GBps": gbps(b16, base),
                              "int8_bytes": b8, "bf16_bytes": b16,
                              "speedup": base / ms})  # fmt: skip
        row("int8 GEMV", f"{n}x{k} M=1", ms, base, b8)
        row("int8 GEMV", f"{n}x{k} M=4", timing["m4_int8_ms"], timing["m4_bf16_ms"], b8)
    torch.cuda.empty_cache()
    return out


def _time_gemv(
    x: torch.Tensor,
    x4: torch.Tensor,
    qs: list[torch.Tensor],
    ws: list[torch.Tensor],
    scale: torch.Tensor,
    cfg: gemv.GemvConfig,
) -> dict[str, float]:
    return {
        "int8_ms": graph_ms_per_call([lambda c=c: gemv.int8_linear(x, c, scale, config=cfg)
                                      for c in qs]),
        "bf16_ms": graph_ms_per_call([lambda c=c: F.linear(x, c) for c in ws]),
        "m4_int8_ms": graph_ms_per_call([lambda c=c: gemv.int8_linear(x4, c, scale) for c in qs]),
        "m4_bf16_ms": graph_ms_per_call([lambda c=c: F.linear(x4, c) for c in ws]),
    }  # fmt: skip


def _projection_stack(*forms: Callable[[torch.Tensor], Any]) -> tuple[list, list[list]]:
    """The 36 layers' packed projections (in: 25088x2048, out: 2048x13056) as random bf16
    weights, each kept in every form asked for, and the inputs they multiply in order."""
    x_in = torch.randn(1, HIDDEN, device=DEV, dtype=BF16)
    x_out = torch.randn(1, 13056, device=DEV, dtype=BF16)
    weights: list[list] = [[] for _ in forms]
    for _ in range(LAYERS):
        for n, k in ((25088, 2048), (2048, 13056)):
            w = torch.randn(n, k, device=DEV, dtype=BF16) * 0.02
            for kept, form in zip(weights, forms, strict=True):
                kept.append(form(w))
    return [x_in, x_out] * LAYERS, weights


def bench_gemv_stack() -> dict[str, Any]:
    """The 36-layer projection stack (packed in + packed out) in one graph: int8 vs bf16."""
    xs, (w16, w8) = _projection_stack(lambda w: w, gemv.quantize_int8)

    def run16() -> None:
        for w, x in zip(w16, xs, strict=True):
            F.linear(x, w)

    def run8(pdl: bool) -> None:
        for (q, s), x in zip(w8, xs, strict=True):
            gemv.int8_linear(x, q, s, launch_pdl=pdl)

    b16 = sum(w.numel() * 2 for w in w16)
    b8 = sum(q.numel() + s.numel() * 4 for q, s in w8)
    ms16, ms8, ms8p = graph_ms(run16), graph_ms(lambda: run8(False)), graph_ms(lambda: run8(True))
    w16.clear()
    w8.clear()
    torch.cuda.empty_cache()
    row("GEMV stack (graph)", "36 x (25088x2048 + 2048x13056)", ms8, ms16, b8)
    row("GEMV stack (graph, PDL)", "same", ms8p, ms16, b8)
    return {"bf16_ms": ms16, "int8_ms": ms8, "int8_pdl_ms": ms8p, "bf16_bytes": b16,
            "int8_bytes": b8, "bf16_GBps": gbps(b16, ms16), "int8_GBps": gbps(b8, ms8),
            "int8_pdl_GBps": gbps(b8, ms8p)}  # fmt: skip


# --------------------------------------------------------------------------- INT6


def bench_int6(tune: bool) -> dict[str, Any]:
    """INT6 vs INT8 on the same weights: per shape, then the 36-layer packed stack."""
    out: dict[str, Any] = {"shapes": [], "tuning": {}}
    for n, k, what in GEMV_SHAPES:
        w = torch.randn(n, k, device=DEV, dtype=BF16) * 0.02
        p6, s6 = g6.quantize_int6(w)
        q8, s8 = gemv.quantize_int8(w)
        x = torch.randn(1, k, device=DEV, dtype=BF16)
        if tune:
            best, times = g6.tune_int6_linear(x, p6, s6)
            ranked = sorted(times.items(), key=lambda i: i[1])
            out["tuning"][f"{n}x{k}"] = [vars(c) | {"ms": t} for c, t in ranked]
            print(f"  int6 tuned {n}x{k}: {best} {times[best] * 1e3:.1f} us", flush=True)
        cfg = g6._TUNED.get((str(DEV), n, k)) or g6.default_config(n, k)
        y = g6.int6_linear(x, p6, s6, config=cfg)
        ref = F.linear(x, w)
        errs = {"rel_err_vs_ref": rel_err(y, g6.int6_linear_ref(x, p6, s6)),
                "rel_err_vs_bf16_weights": rel_err(y, ref),
                "int8_rel_err_vs_bf16_weights": rel_err(gemv.int8_linear(x, q8, s8), ref),
                "rel_err_pdl_vs_plain": rel_err(g6.int6_linear(x, p6, s6, config=cfg,
                                                               launch_pdl=True), y)}  # fmt: skip
        ms6 = graph_ms_per_call([lambda c=c, x=x, s=s6, cfg=cfg: g6.int6_linear(x, c, s, config=cfg)
                                 for c in copies_of(p6)])  # fmt: skip
        ms6_default = graph_ms_per_call([lambda c=c, x=x, s=s6: g6.int6_linear(x, c, s)
                                         for c in copies_of(p6)])  # fmt: skip
        cfg8 = gemv._TUNED.get((str(DEV), True, n, k)) or gemv.default_config(n, k)
        ms8 = graph_ms_per_call([lambda c=c, x=x, s=s8, cfg=cfg8: gemv.int8_linear(x, c, s,
                                                                                   config=cfg)
                                 for c in copies_of(q8)])  # fmt: skip
        b6 = p6.numel() + 4 * n + 2 * k + 2 * n
        b8 = q8.numel() + 4 * n + 2 * k + 2 * n
        out["shapes"].append({"N": n, "K": k, "what": what, "config": vars(cfg), **errs,
                              "int6_ms": ms6, "int6_default_ms": ms6_default, "int8_ms": ms8,
                              "int6_bytes": b6, "int8_bytes": b8, "int6_GBps": gbps(b6, ms6),
                              "int8_GBps": gbps(b8, ms8),
                              "int6_vs_int8": ms8 / ms6})  # fmt: skip
        row("int6 GEMV (base: int8)", f"{n}x{k} M=1", ms6, ms8, b6)
        del w, p6, q8
    torch.cuda.empty_cache()
    out["stack"] = _int6_stack()
    return out


def _int6_stack() -> dict[str, Any]:
    xs, (w6, w8) = _projection_stack(g6.quantize_int6, gemv.quantize_int8)

    def run6(pdl: bool) -> None:
        for (p, s), x in zip(w6, xs, strict=True):
            g6.int6_linear(x, p, s, launch_pdl=pdl)

    def run8(pdl: bool) -> None:
        for (q, s), x in zip(w8, xs, strict=True):
            gemv.int8_linear(x, q, s, launch_pdl=pdl)

    b6 = sum(p.numel() + s.numel() * 4 for p, s in w6)
    b8 = sum(q.numel() + s.numel() * 4 for q, s in w8)
    ms6, ms6p = graph_ms(lambda: run6(False)), graph_ms(lambda: run6(True))
    ms8p = graph_ms(lambda: run8(True))
    w6.clear()
    w8.clear()
    torch.cuda.empty_cache()
    row("GEMV stack int6 (graph, PDL)", "36 x (25088x2048 + 2048x13056)", ms6p, ms8p, b6)
    return {"int6_ms": ms6, "int6_pdl_ms": ms6p, "int8_pdl_ms": ms8p, "int6_bytes": b6,
            "int8_bytes": b8, "int6_pdl_GBps": gbps(b6, ms6p), "int8_pdl_GBps": gbps(b8, ms8p),
            "int6_vs_int8": ms8p / ms6p}  # fmt: skip


# --------------------------------------------------------------------------- attention


def _time_attention(
    q: torch.Tensor,
    caches: list[tuple[torch.Tensor, ...]],
    dev_len: torch.Tensor,
    kw: dict[str, int],
    lo: int,
    length: int,
) -> tuple[float, float, float]:
    qs = q[:, :, None]  # [1, Hq, 1, D] for SDPA
    ms = graph_ms_per_call([lambda kc=kc, vc=vc: attn.decode_attention(q, kc, vc, dev_len, **kw)
                            for kc, vc in caches])  # fmt: skip
    ms_pdl = graph_ms_per_call([lambda kc=kc, vc=vc: attn.decode_attention(
        q, kc, vc, dev_len, launch_pdl=True, **kw) for kc, vc in caches])  # fmt: skip
    ms_sdpa = graph_ms_per_call([lambda kc=kc, vc=vc: F.scaled_dot_product_attention(
        qs, kc[:, :, lo:length], vc[:, :, lo:length], enable_gqa=True)
        for kc, vc in caches])  # fmt: skip
    return ms, ms_pdl, ms_sdpa


def bench_attention() -> list[dict[str, Any]]:
    """Per-layer times over 48 separate caches (as 36 layers would be: no L2 reuse)."""
    s_max, n_caches = 8192, 48
    q = torch.randn(1, HQ, D, device=DEV, dtype=BF16)
    caches = [tuple(torch.randn(1, HKV, s_max, D, device=DEV, dtype=BF16) for _ in range(2))
              for _ in range(n_caches)]  # fmt: skip
    k, v = caches[0]
    results = []
    shapes = [
        (32, 64, 2),
        (64, 64, 2),
        (32, 64, 3),
        (64, 64, 3),
        (32, 128, 2),
        (16, 64, 2),
        (64, 32, 3),
    ]  # (num_splits, block_s, num_stages)
    cases = [(L, 0, *sh) for L in (1124, 4096, 8192) for sh in shapes]
    cases += [(8192, 4096, 32, 64, 2)]  # sliding window at the longest length
    for length, window, splits, block_s, stages in cases:
        dev_len = torch.tensor([length], dtype=torch.int32, device=DEV)
        kw = {"window": window, "num_splits": splits, "block_s": block_s, "num_stages": stages}
        out = attn.decode_attention(q, k, v, dev_len, **kw)
        lo = max(0, length - window) if window else 0
        err = rel_err(out, attn.decode_attention_ref(q, k, v, length, window=window))
        err_pdl = rel_err(attn.decode_attention(q, k, v, dev_len, launch_pdl=True, **kw), out)
        ms, ms_pdl, ms_sdpa = _time_attention(q, caches, dev_len, kw, lo, length)
        nbytes = 2 * HKV * (length - lo) * D * 2 + 2 * 2 * HQ * D
        results.append({"length": length, **kw, "rel_err_vs_ref": err, "rel_err_pdl": err_pdl,
                        "ms": ms, "pdl_ms": ms_pdl, "sdpa_sliced_ms": ms_sdpa, "bytes": nbytes,
                        "GBps": gbps(nbytes, ms)})  # fmt: skip
    for length in (1124, 4096, 8192):  # the table shows the best split per length
        best = min((r for r in results if r["length"] == length and not r["window"]),
                   key=lambda r: r["pdl_ms"])  # fmt: skip
        label = (f"L={length} splits={best['num_splits']} bs={best['block_s']} "
                 f"st={best['num_stages']} (PDL)")  # fmt: skip
        row(
            "decode attention / layer", label, best["pdl_ms"], best["sdpa_sliced_ms"], best["bytes"]
        )
    caches.clear()
    torch.cuda.empty_cache()
    return results


# --------------------------------------------------------------------------- sampler


def _tv(draws: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    return 0.5 * float((counts / draws.numel() - probs.double()).abs().sum())


def torch_sampler(logits: torch.Tensor, top_k: int = 30, temperature: float = 0.8) -> torch.Tensor:
    """The baseline: topk -> softmax -> multinomial -> column (no host sync either)."""
    vals, idx = torch.topk(logits, top_k)
    probs = torch.softmax(vals.float() / temperature, dim=-1)
    return idx.gather(0, torch.multinomial(probs, 1))


def bench_sampler() -> list[dict[str, Any]]:
    results = []
    variants = [(2049, 4096, 4096), (16385, 4096, 4096), (16385, 2048, 4096),
                (277404, 8192, 4096), (277404, 4096, 4096), (277404, 2048, 4096)]  # fmt: skip
    for width, block, single in variants:
        logits = torch.randn(width, device=DEV, dtype=BF16) * 3
        counter = torch.zeros(1, dtype=torch.int64, device=DEV)
        kw = {"block_v": block, "single_max": single}
        draws = samp.sample_top_k(logits, counter, seed=1, num_samples=8192, **kw)
        tv = _tv(draws, samp.top_k_probs_ref(logits))
        ours = lambda: samp.sample_top_k(logits, counter, seed=1, **kw)  # noqa: E731, B023
        base = lambda: torch_sampler(logits)  # noqa: E731, B023
        ms, ms_base = graph_ms(ours), graph_ms(base)
        pdl = lambda: samp.sample_top_k(logits, counter, seed=1, launch_pdl=True, **kw)  # noqa: E731, B023
        ms_pdl = graph_ms(pdl)
        results.append({"width": width, "block_v": block, "single_max": single,
                        "tv_8192_draws": tv, "ms": ms, "pdl_ms": ms_pdl,
                        "torch_ms": ms_base})  # fmt: skip
        row("sampler top-30", f"V={width} block={block} single<={single}", ms, ms_base, 2 * width)
        print(f"  sampler V={width} block={block}: {ms * 1e3:.1f} us, tv {tv:.3f}", flush=True)
    return results


# --------------------------------------------------------------------------- norm + rotary


def bench_rope_norm() -> list[dict[str, Any]]:
    x, r = (torch.randn(1, HIDDEN, device=DEV, dtype=BF16) for _ in range(2))
    w = torch.rand(HIDDEN, device=DEV, dtype=BF16) + 0.5
    cos, sin = rn.rope_cos_sin(8192, device=DEV)
    packed = torch.randn(1, 3072, device=DEV, dtype=BF16)
    q = packed[0, :2048].view(HQ, D)
    k, v = packed[0, 2048:2560].view(HKV, D), packed[0, 2560:].view(HKV, D)
    kc, vc = (torch.zeros(HKV, 8192, D, device=DEV, dtype=BF16) for _ in range(2))
    pos = torch.tensor([1234], device=DEV)
    xn, s = rn.add_layer_norm(x, r, w)
    xn_ref, s_ref = rn.add_layer_norm_ref(x, r, w)
    q_out = rn.rope_and_cache_write(q, k, v, kc, vc, pos, cos, sin)
    kc2, vc2 = kc.clone(), vc.clone()
    q_ref = rn.rope_and_cache_write_ref(q, k, v, kc2, vc2, 1234, cos, sin)
    errs = {"layer_norm": rel_err(rn.layer_norm(x, w), rn.layer_norm_ref(x, w)),
            "add_layer_norm": rel_err(xn, xn_ref), "residual_sum": rel_err(s, s_ref),
            "rope_q": rel_err(q_out, q_ref),
            "rope_k_cache": rel_err(kc[:, 1234], kc2[:, 1234])}  # fmt: skip

    def torch_rope() -> None:
        p = pos  # eager equivalent: index the tables with the device position, no sync
        c = cos[p].float().repeat_interleave(2, -1)
        sn = sin[p].float().repeat_interleave(2, -1)
        for t in (q, k):
            tf = t.float()
            (tf * c + torch.stack([-tf[:, 1::2], tf[:, ::2]], -1).flatten(-2) * sn).to(BF16)
        kc.index_copy_(1, p, k[:, None])
        vc.index_copy_(1, p, v[:, None])

    cases = [
        ("layer_norm", lambda: rn.layer_norm(x, w), lambda: rn.layer_norm_ref(x, w)),
        ("add_layer_norm", lambda: rn.add_layer_norm(x, r, w),
         lambda: rn.add_layer_norm_ref(x, r, w)),
        ("rope+cache write", lambda: rn.rope_and_cache_write(q, k, v, kc, vc, pos, cos, sin),
         torch_rope),
    ]  # fmt: skip
    results = []
    for name, ours, base in cases:
        ms, ms_base = graph_ms(ours), graph_ms(base)
        results.append({"op": name, "ms": ms, "torch_ms": ms_base})
        row(name, "1x2048 / 16+4 heads", ms, ms_base, 0)
    results.append({"rel_errs": errs})
    return results


# --------------------------------------------------------------------------- report


def print_table(copy: dict[str, float]) -> None:
    ceiling = copy["GBps"]
    print(f"\ncopy ceiling: {ceiling:.0f} GB/s (8.6 GB D2D copy, read + write)")
    head = (f"{'kernel':<28}{'shape':<42}{'ours us':>10}{'base us':>10}{'speedup':>9}"
            f"{'GB/s':>8}{'%copy':>7}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in ROWS:
        base = f"{r['base_us']:.1f}" if r["base_us"] is not None else "-"
        speed = f"{r['base_us'] / r['us']:.2f}x" if r["base_us"] else "-"
        bw = f"{r['GBps']:.0f}" if r["GBps"] else "-"
        pct = f"{100 * r['GBps'] / ceiling:.0f}%" if r["GBps"] else "-"
        print(f"{r['kernel']:<28}{r['shape']:<42}{r['us']:>10.1f}{base:>10}{speed:>9}"
              f"{bw:>8}{pct:>7}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results path")
    ap.add_argument("--no-tune", action="store_true", help="use the shipped GEMV configs")
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.time()
    res: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda,
        "capability": list(torch.cuda.get_device_capability()),
    }  # fmt: skip
    res["copy"] = copy_bandwidth()
    print(f"copy: {res['copy']['GBps']:.0f} GB/s", flush=True)
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("gemv", lambda: bench_gemv(not args.no_tune)),
        ("gemv_stack", bench_gemv_stack),
        ("int6", lambda: bench_int6(not args.no_tune)),
        ("attention", bench_attention),
        ("rope_norm", bench_rope_norm),
        ("sampler", bench_sampler),
    ]
    for name, fn in sections:
        if name in skip:
            continue
        t = time.time()
        try:
            res[name] = fn()
        except Exception as exc:  # keep the other sections' numbers
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: FAILED {exc!r}", flush=True)
        print(f"{name}: {time.time() - t:.1f} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, default=str))  # partial results survive
    res["wall_s"] = time.time() - t0
    args.out.write_text(json.dumps(res, indent=1, default=str))
    print_table(res["copy"])
    print(f"\nwrote {args.out} in {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
