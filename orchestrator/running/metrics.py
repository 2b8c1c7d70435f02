"""Speed metrics from per-utterance records, always from unrounded values.

RTF is aggregate: total synthesis time over total audio, as both write-ups define it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from orchestrate.api.config import Workload
from orchestrate.api.records import UtteranceRecord


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def is_valid(u: UtteranceRecord) -> bool:
    return u.finite and u.frames > 0 and u.audio_s > 0


def summarize(utts: Sequence[UtteranceRecord]) -> dict[str, float]:
    if not utts:
        return {}
    lat = [u.latency_s for u in utts]
    total_t = sum(lat)
    total_audio = sum(u.audio_s for u in utts)
    lm = sum(u.lm_s for u in utts)
    tokens = sum(u.new_tokens for u in utts)
    out = {
        "utterances": float(len(utts)),
        "valid_recordings": float(sum(is_valid(u) for u in utts)),
        "median_latency_s": statistics.median(lat),
        "p95_latency_s": percentile(lat, 95),
        "mean_latency_s": total_t / len(utts),
        "total_audio_s": total_audio,
        "median_lm_s": statistics.median(u.lm_s for u in utts),
        "median_codec_s": statistics.median(u.codec_s for u in utts),
        "clipped_samples": float(sum(u.clipped_samples for u in utts)),
    }
    # Ratios only where defined: a store refuses NaN/inf rather than guess what it meant.
    if total_audio > 0 and total_t > 0:
        out["rtf"] = total_t / total_audio
        out["audio_s_per_compute_s"] = total_audio / total_t
    if lm > 0 and tokens > 0:
        out["tokens_per_s"] = tokens / lm
        out["ms_per_token"] = 1000 * lm / tokens
    if total_t > 0:
        out["lm_share"] = lm / total_t
    ttfa = [u.time_to_first_audio_s for u in utts if u.time_to_first_audio_s is not None]
    if ttfa:
        out["median_ttfa_s"] = statistics.median(ttfa)
    return out


def compare(base: Sequence[UtteranceRecord], cand: Sequence[UtteranceRecord]) -> dict[str, float]:
    """Candidate vs baseline: aggregate ratios plus the median of paired ratios.

    Pairs are the same (prompt, seed, round): measured back to back in the interleaved run.
    """
    b, c = summarize(base), summarize(cand)
    if "rtf" not in b or "rtf" not in c:
        return {}
    out = {
        "speedup_vs_baseline": b["rtf"] / c["rtf"],
        "latency_speedup_vs_baseline": b["median_latency_s"] / c["median_latency_s"],
    }
    by_key = {(u.prompt_id, u.seed, u.round): u for u in base}
    ratios = [
        by_key[k].latency_s / u.latency_s
        for u in cand
        if (k := (u.prompt_id, u.seed, u.round)) in by_key and u.latency_s > 0
    ]
    if ratios:
        out["paired_median_speedup"] = statistics.median(ratios)
    return out


def point_metrics(utts: Sequence[UtteranceRecord], workload: Workload) -> dict[str, float]:
    """Median RTF per operating point and S = sum(weight x median RTF), the write-up's
    primary speed metric; S only when every declared point has recordings."""
    if not workload.operating_points:
        return {}
    point_of = {p.id: p.point for p in workload.prompts}
    out: dict[str, float] = {}
    for name in workload.operating_points:
        rtfs = [
            u.latency_s / u.audio_s
            for u in utts
            if point_of.get(u.prompt_id) == name and u.audio_s > 0
        ]
        if rtfs:
            out[f"median_rtf_{name}"] = statistics.median(rtfs)
    if len(out) == len(workload.operating_points):
        out["S"] = sum(
            op.weight * out[f"median_rtf_{name}"] for name, op in workload.operating_points.items()
        )
    return out


def compare_s(base: dict[str, float], cand: dict[str, float]) -> dict[str, float]:
    """Speedup in S (lower S is faster) where both stacks have it."""
    if base.get("S", 0) > 0 and cand.get("S", 0) > 0:
        return {"s_speedup_vs_baseline": base["S"] / cand["S"]}
    return {}
