"""Speed metrics from per-utterance records, always from unrounded values.

RTF is aggregate: total synthesis time over total audio, as both write-ups define it.

The headline speedup is defined here once (`headline`): the paired estimate, i.e. per
utterance measured by both stacks (same prompt, seed and round: back to back in the
interleaved run) the ratio baseline time / candidate time, averaged in log space with the
protocol's prompt weights (a weighted geometric mean), with a seeded percentile bootstrap
CI. One slow utterance moves it by one pair's share, where it can swing the aggregate RTF
ratio at will. Runs store it as `speedup_paired` (+ `_lo`, `_hi`); every report, the gate,
MLflow and the ledger read that stored number. `noise_reasons` and `exactness` say when a
stored number or an `exact` claim is not to be trusted.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrate.api.config import Workload
from orchestrate.api.protocol import ProtocolError, SpeedRule
from orchestrate.api.records import ResultRecord, UtteranceRecord

HEADLINE = "speedup_paired"  # + HEADLINE_lo, HEADLINE_hi; HEADLINE_n pairs
AGGREGATE = "speedup_vs_baseline"  # the aggregate RTF ratio, shown beside it only


def headline_label(confidence: float = 0.95) -> str:
    return f"speedup (paired, {confidence:.0%} CI)"


AGGREGATE_LABEL = "RTF ratio (aggregate)"

# A run is `noisy` when the pairs behind its headline disagree: some pair's ratio is more
# than MAX_PAIRED_SPREAD off the median (p95/median or median/p5 of the paired ratios), or
# there are too few pairs to tell. Paired ratios, not raw latencies: prompts of different
# lengths spread latencies (and OmniVoice's fixed step count spreads RTF: 1.53 on clean H200
# runs) without any noise, while a contended utterance shows as one outlying pair (a 25 s
# stock utterance among 1.5 s ones: ~16x against a median of 1.9x). On every committed
# benchmark the spread is <= 1.18. Constants, not protocol fields: a new protocol field
# would change every protocol's content hash, and stored protocols refuse that.
MAX_PAIRED_SPREAD = 1.5
MIN_PAIRS = 2
# A resumed run's segments may run on other hosts (each device call of the en20 run did,
# benchmarks/h200/issue14-en20.result.json): a host-bound stack (stock's Python token
# loop) ran 15.7 ms/token on a host whose
# single-thread loop took 13.1 ms and 25-27 ms/token on slower ones, where exp74-full did
# not move. One host measures its loop within a few percent from run to run.
MAX_HOST_SPREAD = 1.25


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
    hosts = [u.host_loop_ms for u in utts if u.host_loop_ms]
    if hosts:  # slowest host's loop over the fastest's: 1.0 for a run on one host
        out["host_loop_spread"] = max(hosts) / min(hosts)
        if len(hosts) < len(utts):  # some carried from a worker that did not record its host
            out["host_loop_unrecorded"] = float(len(utts) - len(hosts))
    return out


def compare(base: Sequence[UtteranceRecord], cand: Sequence[UtteranceRecord]) -> dict[str, float]:
    """Candidate vs baseline: the aggregate RTF ratio (`speedup_vs_baseline`, shown only as
    "RTF ratio (aggregate)"), the median-latency ratio and the median of paired latency
    ratios. None of these is the headline: that is `headline`.

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


# --------------------------------------------------------------------- paired headline


def _time(u: UtteranceRecord, metric: str) -> float:
    # Per-utterance RTF when the protocol's speed metric is RTF: with a length policy every
    # stack makes the same audio and it equals the latency ratio; with model-decided lengths
    # it does not penalise a stack for longer clips.
    return u.latency_s / u.audio_s if metric == "rtf" else u.latency_s


def paired_log_ratios(
    base: Sequence[UtteranceRecord], cand: Sequence[UtteranceRecord], metric: str = "rtf"
) -> list[tuple[str, float]]:
    """(prompt id, log(base time / candidate time)) per utterance measured by both."""
    by_key = {(u.prompt_id, u.seed, u.round): u for u in base}
    out = []
    for u in cand:
        b = by_key.get((u.prompt_id, u.seed, u.round))
        if b is None or u.latency_s <= 0 or b.latency_s <= 0 or u.audio_s <= 0 or b.audio_s <= 0:
            continue
        if timed_apart(b, u):
            continue  # not measured back to back
        out.append((u.prompt_id, math.log(_time(b, metric) / _time(u, metric))))
    return out


def timed_apart(a: UtteranceRecord, b: UtteranceRecord) -> bool:
    """Timed by different workers: segments of a resumed run (their worker's job ids), or,
    for records older than `timed_by`, one carried over from an interrupted run and one not."""
    if a.timed_by and b.timed_by:
        return a.timed_by != b.timed_by
    return a.resumed != b.resumed


def prompt_weight(prompt_id: str, weights: dict[str, float]) -> float:
    for pattern, weight in weights.items():
        if fnmatch.fnmatchcase(prompt_id, pattern):
            return weight
    raise ProtocolError(f"prompt {prompt_id!r} matches no speed weight pattern {list(weights)}")


def bootstrap_speedup(
    logs: Sequence[float], weights: Sequence[float], rule: SpeedRule
) -> tuple[float, float, float]:
    """(weighted geometric-mean speedup, CI low, CI high) by percentile bootstrap, seeded by
    the rule: the same pairs always give the same interval."""
    import numpy as np

    x, w = np.asarray(logs, dtype=np.float64), np.asarray(weights, dtype=np.float64)
    point = float(np.exp((w * x).sum() / w.sum()))
    rng = np.random.default_rng(rule.seed)
    idx = rng.integers(0, x.size, size=(rule.resamples, x.size))
    means = (w[idx] * x[idx]).sum(axis=1) / w[idx].sum(axis=1)
    alpha = (1 - rule.confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return point, float(np.exp(lo)), float(np.exp(hi))


@dataclass(frozen=True)
class Paired:
    speedup: float
    lo: float
    hi: float
    n: int
    spread: float  # max(p95/median, median/p5) of the paired ratios


def paired_speedup(
    base: Sequence[UtteranceRecord],
    cand: Sequence[UtteranceRecord],
    rule: SpeedRule,
    metric: str = "rtf",
) -> Paired | None:
    """THE headline estimate of `cand` against `base` (None without pairs). Raises
    ProtocolError when a prompt matches none of the rule's weight patterns."""
    pairs = paired_log_ratios(base, cand, metric)
    if not pairs:
        return None
    logs = [lr for _, lr in pairs]
    point, lo, hi = bootstrap_speedup(
        logs, [prompt_weight(p, rule.weights) for p, _ in pairs], rule
    )
    ratios = [math.exp(lr) for lr in logs]
    mid = statistics.median(ratios)
    spread = max(percentile(ratios, 95) / mid, mid / percentile(ratios, 5))
    return Paired(point, lo, hi, len(pairs), spread)


def headline(
    base: Sequence[UtteranceRecord],
    cand: Sequence[UtteranceRecord],
    rule: SpeedRule,
    metric: str = "rtf",
) -> dict[str, float]:
    """The stored form of `paired_speedup`: speedup_paired, _lo, _hi, _n, paired_spread and
    noisy (1.0 when noise_reasons finds any). Empty without pairs or prompt weights (the
    gate refuses such a protocol with its own error; a run is still recorded)."""
    try:
        p = paired_speedup(base, cand, rule, metric)
    except ProtocolError:
        return {}
    if p is None:
        return {}
    out = {
        HEADLINE: p.speedup,
        f"{HEADLINE}_lo": p.lo,
        f"{HEADLINE}_hi": p.hi,
        f"{HEADLINE}_n": float(p.n),
        "paired_spread": p.spread,
    }
    out["noisy"] = float(bool(noise_reasons("", out)))
    return out


def noise_reasons(stack: str, m: Mapping[str, float]) -> list[str]:
    """Why the stored figures of one stack (its metrics, as stored) are not to be trusted;
    [] when they are. Its utterances timed on hosts of different speed (any stack, the
    baseline too), and for a candidate, its paired headline's pairs disagreeing."""
    who = f"{stack}: " if stack else ""
    out = []
    host_spread = m.get("host_loop_spread")
    if host_spread is not None and host_spread > MAX_HOST_SPREAD:
        out.append(
            f"{who}timed on hosts whose single-thread loop differs {host_spread:.2f}x "
            f"(> {MAX_HOST_SPREAD}x; a resumed run's segments?): host-bound figures mix them"
        )
    if HEADLINE not in m:
        return out
    n = int(m.get(f"{HEADLINE}_n", 0))
    if n < MIN_PAIRS:
        out.append(f"{who}{n} paired utterance(s), fewer than {MIN_PAIRS}: spread unknown")
    spread = m.get("paired_spread")
    if spread is not None and spread > MAX_PAIRED_SPREAD:
        out.append(
            f"{who}paired ratios spread {spread:.2f}x around their median "
            f"(> {MAX_PAIRED_SPREAD}x): an outlying utterance (contention?)"
        )
    return out


def run_noise(stacks: Sequence[tuple[str, Mapping[str, float]]]) -> list[str]:
    """noise_reasons over a run's stacks (name, stored metrics): the run is noisy if any."""
    return [r for name, m in stacks for r in noise_reasons(name, m)]


def result_noise(result: ResultRecord, comparisons: Mapping[str, Mapping[str, float]]) -> list[str]:
    """run_noise of a fresh result, before it is stored: every stack's worker metrics (the
    baseline's host spread among them) with its comparisons (the candidates' headlines)."""
    return run_noise(
        [(r.stack.name, {**r.metrics, **comparisons.get(r.stack.name, {})}) for r in result.results]
    )


# --------------------------------------------------------------------------- exactness

Exactness = Literal["exact", "failed", "unmeasured", "approximate"]
EXACT_CELL: dict[str, str] = {
    "exact": "yes",
    "unmeasured": "yes (unmeasured)",
    "failed": "NO (measured)",
    "approximate": "APPROX",
}


def exactness(
    declared_exact: bool, within_tolerance: bool | None, techniques: int = 1
) -> Exactness:
    """The measured verdict on a stack's `exact` claim: a plugin declaring exact is trusted
    only as far as fidelity measured it. Stock (no techniques) is the reference."""
    if not declared_exact:
        return "approximate"
    if techniques == 0:
        return "exact"
    if within_tolerance is None:
        return "unmeasured"
    return "exact" if within_tolerance else "failed"


# ------------------------------------------------------------------------------ guards
# The kernel-benchmark leaderboards' lessons: a time faster than the hardware allows is a
# bug (skipped work, a timer stopped before the device finished), never a win. The store
# keeps a stack's metrics, not its record's guard fields, so each verdict is also a metric
# (set by running/guards.mark) and the floor verdict is recomputed from stored metrics.

INVALID = "invalid"  # 1.0: timings faster than their floor; never accepted
SAME_AUDIO = "audio_independent_of_input"  # 1.0: two inputs, one waveform
SAME_AUDIO_ROUNDS = ("audio_same_round_a", "audio_same_round_b")  # which two (their rounds)
FIDELITY_FAILED = "fidelity_failed"  # 1.0: this stack's fidelity check raised


def floor_violations(m: Mapping[str, float]) -> list[str]:
    """Why a stack's stored timings cannot be real: a token (or whole-sequence forward)
    measured faster than moving its bytes at the copy bandwidth measured on the same
    device. [] when none, or when no floor is known."""
    out = []
    for per in ("token", "forward"):
        took, floor = m.get(f"ms_per_{per}"), m.get(f"floor_ms_per_{per}")
        if took is not None and floor is not None and took < floor:
            out.append(
                f"{took:.4g} ms per {per} is faster than its floor of {floor:.4g} ms (its bytes "
                "at the measured copy bandwidth): work skipped, or a timer stopped early"
            )
    return out


def invalid_reasons(m: Mapping[str, float], recorded: str | None = None) -> list[str]:
    """Why a stack (its stored metrics; its record's `invalid` where there is one) must not
    be believed or accepted; [] when nothing says so."""
    reasons = floor_violations(m)
    if not reasons and (recorded or m.get(INVALID)):
        reasons = [recorded or "marked invalid when it was measured"]
    return reasons
