"""Noise first: how much does every metric move when nothing changes?

`orchestrate noise --stack stock --repeats N` runs N jobs of one stack against an A/A copy
of itself (same techniques, another name), interleaved. Repeat r samples with seeds shifted
by r x `noise.seed_stride`, so the spread between repeats includes sampling noise: what an
equally good candidate would show. Every recording is scored.

From that:
- speed: each repeat's A/A paired speedup and bootstrap CI. Identical stacks should give
  1.0; how far the CI reaches is the timing noise. The proposed `speed.min_speedup` is the
  widest A/A bound seen (max of CI high and 1 / CI low), so a candidate must beat what
  noise alone produced. `NoiseAnalysis.min_speedup_derivation` spells that out with the
  measured numbers.
- refusal: a machine whose A/A timings spread more than `noise.max_aa_cv` (sd/mean of the
  speed metric over every A/A measurement) gets no protocol: gates set there would encode
  the machine's noise, not the method's (`TooNoisy`).
- quality: per gated metric, stock's per-repeat means. Tolerance = max(k x sqrt(2) x sd,
  the largest difference between two repeats, the largest same-seed A/A difference, the
  metric's floor); sqrt(2) because a gate compares two runs, each with that sd.
The result is written as a new protocol version (never over the frozen one in place).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.api.config import ModelSpec, StackSpec, Workload
from orchestrate.api.protocol import Gate, Protocol, bumped, phase_workload, require_same
from orchestrate.api.records import ResultRecord
from orchestrate.research.decide import SpeedCheck, speed_check

if TYPE_CHECKING:
    from orchestrate.research.scoring_run import StackQuality
    from orchestrate.store.store import Store

AA_SUFFIX = ".aa"
SPEED_METRICS = ("rtf", "median_latency_s", "p95_latency_s", "tokens_per_s", "median_ttfa_s")


class NoiseError(RuntimeError):
    pass


class TooNoisy(NoiseError):
    """The A/A spread exceeds the protocol's `noise.max_aa_cv`: no protocol is proposed."""


def aa_copy(stack: StackSpec) -> StackSpec:
    return stack.model_copy(
        update={
            "name": stack.name + AA_SUFFIX,
            "description": f"A/A copy of {stack.name}: the same techniques, timed interleaved",
        }
    )


def noise_workload(dev: Workload, repeat: int, stride: int) -> Workload:
    """`dev` with seeds shifted for repeat `repeat`, every recording kept, warm-up >= 1."""
    data = dev.model_dump() | {
        "name": phase_workload(dev.name, "noise"),
        "seeds": [s + repeat * stride for s in dev.seeds],
        "warmups": max(1, dev.warmups),
        "save_audio": len(dev.prompts) * len(dev.seeds),
    }
    return Workload.model_validate(data)


# ---------------------------------------------------------------------------- analysis


@dataclass
class Spread:
    metric: str
    values: list[float]  # one per repeat
    mean: float
    sd: float
    max_pair_delta: float
    same_seed_delta: float | None = None  # largest |A/A - stock| inside one repeat
    tolerance: float | None = None
    rule: str = ""


@dataclass
class NoiseAnalysis:
    runs: list[str]
    stack: str
    aa: list[SpeedCheck]
    min_speedup: float
    speed: dict[str, Spread] = field(default_factory=dict)
    quality: dict[str, Spread] = field(default_factory=dict)
    coverage_failures: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The speed metric of the stack and its A/A copy, every repeat: sd/mean is the machine's
    # timing noise, judged against `noise.max_aa_cv` before any protocol is proposed.
    aa_timing: Spread | None = None
    aa_cv: float = 0.0
    # How min_speedup came from the A/A checks: one term per repeat, and the formula with them.
    min_speedup_terms: list[dict[str, Any]] = field(default_factory=list)
    min_speedup_derivation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _spread(metric: str, values: Sequence[float]) -> Spread:
    pairs = [abs(a - b) for a, b in itertools.combinations(values, 2)]
    return Spread(
        metric=metric,
        values=list(values),
        mean=statistics.fmean(values),
        sd=statistics.stdev(values) if len(values) > 1 else 0.0,
        max_pair_delta=max(pairs, default=0.0),
    )


def _round_up(x: float, digits: int = 4) -> float:
    """Round up to `digits` significant digits (a tolerance is never rounded tighter)."""
    if x <= 0:
        return 0.0
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def analyse(
    run_ids: Sequence[str],
    results: Sequence[ResultRecord],
    qualities: Sequence[dict[str, StackQuality]],
    protocol: Protocol,
) -> NoiseAnalysis:
    """Spread of every metric over A/A repeats (stored results and their scores)."""
    if len(results) < 2:
        raise NoiseError(f"noise needs at least 2 repeats to see a spread, got {len(results)}")
    hashes = zip(run_ids, (r.job.protocol.content_hash() for r in results), strict=True)
    require_same({f"run {run}": digest for run, digest in hashes})
    stack = results[0].job.baseline.name
    aa_checks = []
    for res in results:
        by_name = {r.stack.name: r for r in res.results}
        if set(by_name) != {stack, stack + AA_SUFFIX}:
            raise NoiseError(
                f"job {res.job.job_id} is not an A/A job of {stack}: {sorted(by_name)}"
            )
        aa_checks.append(
            speed_check(
                "noise",
                by_name[stack],
                by_name[stack + AA_SUFFIX],
                protocol.speed,
                protocol.speed_metric,
            )
        )
    bounds = [max(c.ci_high, 1 / c.ci_low) for c in aa_checks if c.n_pairs]
    if not bounds:
        raise NoiseError("no paired utterances in any repeat: nothing to measure")
    out = NoiseAnalysis(list(run_ids), stack, aa_checks, _round_up(max(1.0, *bounds), 4))
    out.min_speedup_terms, out.min_speedup_derivation = _derivation(out, protocol)
    metric = protocol.speed_metric
    timings = [r.metrics[metric] for res in results for r in res.results if metric in r.metrics]
    if len(timings) > 1:
        out.aa_timing = _spread(f"{metric} (A/A, {stack} and {stack}{AA_SUFFIX})", timings)
        mean = out.aa_timing.mean
        out.aa_cv = out.aa_timing.sd / mean if mean > 0 else math.inf
    for metric in SPEED_METRICS:
        vals = [r.results[0].metrics[metric] for r in results if metric in r.results[0].metrics]
        if len(vals) == len(results):
            out.speed[metric] = _spread(metric, vals)
    rule = protocol.noise
    for metric in protocol.quality.noise_gated:
        per_repeat = [q[stack].values.get(metric) for q in qualities]
        if any(v is None for v in per_repeat):
            out.notes.append(f"{metric}: not scored in every repeat; no gate proposed")
            continue
        spread = _spread(metric, per_repeat)  # type: ignore[arg-type]
        same = [
            abs(q[stack + AA_SUFFIX].values[metric] - q[stack].values[metric])
            for q in qualities
            if metric in q[stack + AA_SUFFIX].values
        ]
        spread.same_seed_delta = max(same, default=None)
        candidates = {
            f"{rule.k:g}·√2·sd": rule.k * math.sqrt(2) * spread.sd,
            "max repeat Δ": spread.max_pair_delta,
            "same-seed A/A Δ": spread.same_seed_delta or 0.0,
            "floor": rule.floors.get(metric, 0.0),
        }
        basis = max(candidates, key=lambda k: candidates[k])
        spread.tolerance = _round_up(candidates[basis])
        spread.rule = basis
        if not spread.tolerance:
            out.notes.append(f"{metric}: zero spread and no floor; no gate proposed")
            continue
        out.quality[metric] = spread
    out.coverage_failures = [q[stack].coverage_failures for q in qualities]
    return out


def _derivation(out: NoiseAnalysis, protocol: Protocol) -> tuple[list[dict[str, Any]], str]:
    """Per-repeat terms of min_speedup and the formula written out with them: exactly what
    `analyse` computes (the widest A/A bound, rounded up), so nobody has to guess."""
    terms, parts = [], []
    for i, (run, c) in enumerate(zip(out.runs, out.aa, strict=True), 1):
        bound = max(c.ci_high, 1 / c.ci_low) if c.n_pairs else None
        terms.append(
            {"repeat": i, "run": run, "speedup": c.speedup, "ci_low": c.ci_low,
             "ci_high": c.ci_high, "n_pairs": c.n_pairs, "bound": bound}
        )  # fmt: skip
        parts.append(
            f"repeat {i}: max({c.ci_high:.4f}, 1/{c.ci_low:.4f}) = {bound:.4f}"
            if bound is not None
            else f"repeat {i}: no pairs"
        )
    rule = protocol.speed
    text = (
        f"min_speedup {out.min_speedup:g} = max(1, max over {len(terms)} repeats of "
        f"max(CI high, 1/CI low)), rounded up to 4 significant digits; CI: "
        f"{rule.confidence:.0%} bootstrap ({rule.resamples} resamples) of the paired "
        f"{protocol.speed_metric} speedup of {out.stack}{AA_SUFFIX} vs {out.stack}; "
        + "; ".join(parts)
    )
    return terms, text


def check_quiet(protocol: Protocol, analysis: NoiseAnalysis) -> None:
    """Refuse (TooNoisy) when the A/A timing spread exceeds the protocol's bound."""
    bound = protocol.noise.max_aa_cv
    if analysis.aa_cv <= bound or analysis.aa_timing is None:
        return
    t = analysis.aa_timing
    raise TooNoisy(
        f"machine too noisy: sd/mean {_pct(analysis.aa_cv)} > {_pct(bound)} (protocol "
        f"{protocol.name} v{protocol.version} noise.max_aa_cv); {t.metric} ranged "
        f"{min(t.values):.3g} to {max(t.values):.3g} over {len(analysis.runs)} repeats; "
        "re-run on a quiet device (no protocol written; the A/A runs stay recorded)"
    )


def _pct(x: float) -> str:
    return f"{x * 100:.3g}%"


def propose(protocol: Protocol, analysis: NoiseAnalysis, version: int | None = None) -> Protocol:
    """The next protocol version: gates and min_speedup from `analysis`; manual gates and
    gates on metrics noise did not measure are kept. TooNoisy when the A/A timing spread
    exceeds `noise.max_aa_cv`: such gates would measure the machine, not the method.
    `version`: the new version's number (default: the next one; see bumped)."""
    check_quiet(protocol, analysis)
    measured = set(analysis.quality)
    kept = [g for g in protocol.quality.gates if g.origin == "manual" or g.metric not in measured]
    runs = ", ".join(r[:8] for r in analysis.runs)
    new = []
    for metric, sp in analysis.quality.items():
        lower = protocol.quality.metrics[metric].better == "lower"
        note = (
            f"{len(sp.values)} repeats of {analysis.stack} (runs {runs}): mean {sp.mean:.4g}, "
            f"sd {sp.sd:.3g}, max repeat Δ {sp.max_pair_delta:.3g}; tolerance = {sp.rule}"
        )
        bound = {"max_delta": sp.tolerance} if lower else {"min_delta": -sp.tolerance}  # type: ignore[operator]
        new.append(Gate(metric=metric, origin="noise", note=note, **bound))
    aa = "; ".join(f"{c.speedup:.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}]" for c in analysis.aa)
    speed = protocol.speed.model_copy(
        update={
            "min_speedup": analysis.min_speedup,
            "origin": "noise",
            "note": f"A/A {analysis.stack} vs {analysis.stack}{AA_SUFFIX} per repeat: {aa}. "
            + analysis.min_speedup_derivation,
        }
    )
    quality = protocol.quality.model_copy(update={"gates": kept + new})
    return bumped(
        protocol,
        noise_runs=list(analysis.runs),
        version=version,
        quality=quality.model_dump(mode="json"),
        speed=speed.model_dump(mode="json"),
    )


# ----------------------------------------------------------------------------- running


def measure(
    store: Store,
    *,
    stack: StackSpec,
    model: ModelSpec,
    dev: Workload,
    protocol: Protocol,
    repeats: int,
    runs_dir: Path,
    track: bool = False,
    on_event: Callable[[dict[str, Any]], None] = lambda e: None,
) -> NoiseAnalysis:
    """Run the A/A repeats, score them, and analyse the stored records."""
    from orchestrate.research import scoring_run
    from orchestrate.running.executor import run_alone
    from orchestrate.running.plan import plan_job

    if repeats < 2:
        raise NoiseError(f"--repeats must be at least 2 to measure a spread, got {repeats}")
    run_ids = []
    for r in range(repeats):
        on_event({"event": "status", "message": f"noise repeat {r + 1}/{repeats}"})
        wl = noise_workload(dev, r, protocol.noise.seed_stride)
        job = plan_job(model, wl, [stack, aa_copy(stack)], protocol, runs_dir)
        outcome = run_alone(job, store, runs_dir, track=track, force=True, on_event=on_event)
        if outcome.error or outcome.status != "finished":
            raise NoiseError(f"noise repeat {r + 1} did not finish cleanly: {outcome.error}")
        run_ids.append(outcome.run_id)
        on_event({"event": "status", "message": f"scoring repeat {r + 1}/{repeats}"})
        scoring_run.score_run(store, outcome.run_id, protocol)
    return analyse_stored(store, run_ids, protocol)


def analyse_stored(store: Store, run_ids: Sequence[str], protocol: Protocol) -> NoiseAnalysis:
    from orchestrate.research.scoring_run import load_rows, stack_quality

    results = [store.get_result(r) for r in run_ids]
    qualities = [
        stack_quality(res, load_rows(store, rid), protocol)
        for rid, res in zip(run_ids, results, strict=True)
    ]
    return analyse(run_ids, results, qualities, protocol)
