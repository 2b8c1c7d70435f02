"""Figures regenerated from stored records (matplotlib, Agg): never drawn by hand.

- frontier.png: the headline speedup vs stock (paired, as stored) per experiment; the best
  gated speedup (accepted stacks at their holdout paired estimate) as a step line, the best
  of stacks never gated dashed apart ("dev only, not gated"); alerts (retained stacks and
  noisy runs included) hollow red and unverified points hollow grey;
- pareto.png: speedup against a quality delta vs stock, the Pareto set joined;
- quality_screen.png: stock vs candidates on WER, CER, MOS and SIM (one scored run);
- holdout_deltas.png: each holdout evaluation's delta vs stock against the gate bands;
  on random weights both say "not meaningful: random weights" and colour nothing pass/fail;
- ladder.png: the newest run's stacks, speed (S or RTF) with aggregate ratios vs A and B;
- throughput.png: utterances/s against batch size, one line per serving path.
manifest.json records which runs, protocol and database every figure came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.api.config import ModelSpec
from orchestrate.api.protocol import Protocol
from orchestrate.api.records import utcnow
from orchestrate.reports.frontier import Frontier, collect
from orchestrate.reports.ladder import Rung, finished_runs, ladder, throughput
from orchestrate.research.decide import NOT_MEANINGFUL, random_weights
from orchestrate.research.holdout import list_audits
from orchestrate.research.scoring_run import StackQuality, load_rows, stack_quality

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from orchestrate.store.store import Store

SCREEN_METRICS = ("wer", "cer", "mos", "sim")
PHASE_MARKERS = {"dev": "o", "remeasure": "s", "holdout": "D"}
PASS, ALERT, GREY, GREEN, RED = "#1f5fa8", "#c62828", "#9e9e9e", "#c8e6c9", "#ffcdd2"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, same output on any machine
    import matplotlib.pyplot as plt

    return plt


def frontier_figure(data: Frontier, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.axhline(1.0, color=GREY, lw=0.8, ls="--")
    ax.text(0, 1.0, " stock", va="bottom", fontsize=8, color="#616161")
    for p in data.points:
        marker = PHASE_MARKERS.get(p.phase, "o")
        if p.status == "pass":
            ax.scatter(p.index, p.speedup, marker=marker, color=PASS, zorder=3)
        else:
            edge = ALERT if p.status == "alert" else GREY
            ax.scatter(
                p.index,
                p.speedup,
                marker=marker,
                facecolors="none",
                edgecolors=edge,
                linewidths=1.5,
                zorder=3,
            )
    if data.points:  # from stock (1x): the gated best, and apart the never-gated best
        for steps, style, label in (
            (data.frontier, {"color": PASS, "lw": 1.5}, "best gated (holdout paired)"),
            (data.dev_only, {"color": GREY, "lw": 1.0, "ls": "--"}, "best dev only, not gated"),
        ):
            if not steps:
                continue
            at = {s["index"]: s["speedup"] for s in steps}
            best, xs, ys = 1.0, [], []
            for p in data.points:
                best = max(best, at.get(p.index, best))
                xs.append(p.index)
                ys.append(best)
            ax.step(xs, ys, where="post", label=label, **style)
            for s in steps:
                ax.annotate(
                    s["stack"],
                    (s["index"], s["speedup"]),
                    textcoords="offset points",
                    xytext=(4, 6),
                    fontsize=8,
                    color=style["color"],
                )
    for label, kw in (
        ("pass", {"color": PASS}),
        ("quality alert (not counted)", {"facecolors": "none", "edgecolors": ALERT}),
        ("unverified (not counted)", {"facecolors": "none", "edgecolors": GREY}),
    ):
        ax.scatter([], [], label=label, **kw)
    ax.set_xlabel("experiment (time order; o dev, □ remeasure, ◇ holdout)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # experiments are counted
    ax.set_xlim(-0.5, max(len(data.points) - 0.5, 4.5))
    ax.set_ylabel("speedup vs stock (paired geometric mean)")
    ax.set_title(
        f"Speed frontier · {data.workload} · {data.hardware}\nprotocol {data.protocol}", fontsize=10
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def pareto_figure(data: Frontier, path: Path, protocol: Protocol) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    metric = data.pareto_metric
    scored = [p for p in data.points if metric in p.deltas]
    _gate_band(ax, protocol, metric, vertical=True, data=[p.deltas[metric] for p in scored])
    ax.scatter([0.0], [1.0], color="black", marker="*", s=80, label="stock", zorder=4)
    for p in scored:
        color = {"pass": PASS, "alert": ALERT}.get(p.status, GREY)
        ax.scatter(p.deltas[metric], p.speedup, color=color, zorder=3)
        ax.annotate(
            p.stack,
            (p.deltas[metric], p.speedup),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, 3),
        )
    front = data.pareto  # ringed, and joined when there is more than one
    ax.scatter([c["delta"] for c in front], [c["speedup"] for c in front], s=160,
               facecolors="none", edgecolors="black", label="Pareto set", zorder=2)  # fmt: skip
    ax.plot([c["delta"] for c in front], [c["speedup"] for c in front], color="black", lw=0.8,
            ls="--", zorder=2)  # fmt: skip
    better = protocol.quality.metrics[metric].better
    ax.set_xlabel(f"Δ {metric} vs stock ({better} is better)")
    ax.set_ylabel("speedup vs stock (paired geometric mean)")
    ax.set_title(f"Speed vs quality · {data.workload}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def quality_screen_figure(
    quality: dict[str, StackQuality],
    path: Path,
    title: str,
    metrics: tuple[str, ...],
    meaningful: bool = True,
) -> Path:
    plt = _pyplot()
    if not meaningful:  # scores of random weights: drawn, and said to mean nothing
        title = f"{title}\n{NOT_MEANINGFUL}"
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.8), squeeze=False)
    names = list(quality)
    for ax, metric in zip(axes[0], metrics, strict=True):
        vals = [quality[n].values.get(metric) for n in names]
        errs = [_sd(quality[n].per_utterance.get(metric, [])) for n in names]
        colors = [GREY if i == 0 or not meaningful else PASS for i in range(len(names))]
        ax.bar(range(len(names)), [v or 0.0 for v in vals], yerr=errs, color=colors, capsize=3)
        for i, (v, n) in enumerate(zip(vals, names, strict=True)):
            cov = quality[n].coverage_failures
            text = "n/a" if v is None else f"{v:.3g}" + (f"\n{cov} unscored" if cov else "")
            ax.text(i, (v or 0.0), text, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_title(metric.upper(), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def holdout_deltas_figure(
    evaluations: list[dict[str, Any]], protocol: Protocol, path: Path
) -> Path:
    plt = _pyplot()
    metrics = list(dict.fromkeys(g.metric for g in protocol.quality.gates))
    fig, axes = plt.subplots(
        1, max(1, len(metrics)), figsize=(3.6 * max(1, len(metrics)), 4), squeeze=False
    )
    labels = [
        f"{e['stack']}\n{e['when']:%m-%d %H:%M}\n{e['verdict']}"
        + ("" if e["meaningful"] else "\nrandom weights")
        for e in evaluations
    ]
    for ax, metric in zip(axes[0], metrics, strict=False):
        ys = [e["deltas"].get(metric) for e in evaluations]
        _gate_band(ax, protocol, metric, vertical=False, data=[y for y in ys if y is not None])
        for i, (y, e) in enumerate(zip(ys, evaluations, strict=True)):
            if y is not None:
                ok = _within(protocol, metric, y)
                color = GREY if not e["meaningful"] else PASS if ok else ALERT
                ax.scatter(i, y, color=color, zorder=3)
                note = "" if e["meaningful"] else " (not meaningful)"
                ax.annotate(
                    f"{y:+.3g}{note}", (i, y), fontsize=7, textcoords="offset points",
                    xytext=(5, 0),
                )  # fmt: skip
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlim(-0.6, max(0.6, len(labels) - 0.4))
        ax.set_title(f"Δ{metric.upper()} vs stock (holdout)", fontsize=10)
    fig.suptitle(f"Holdout quality deltas vs gates · protocol v{protocol.version}", fontsize=10)
    return _save(fig, path)


# ----------------------------------------------------------------------------- helpers


def _sd(xs: list[float]) -> float:
    import statistics

    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _bounds(protocol: Protocol, metric: str) -> tuple[float | None, float | None]:
    lo, hi = None, None
    for g in protocol.quality.gates:
        if g.metric == metric:
            if g.min_delta is not None:
                lo = g.min_delta if lo is None else max(lo, g.min_delta)
            if g.max_delta is not None:
                hi = g.max_delta if hi is None else min(hi, g.max_delta)
    return lo, hi


def _within(protocol: Protocol, metric: str, delta: float) -> bool:
    lo, hi = _bounds(protocol, metric)
    return (lo is None or delta >= lo) and (hi is None or delta <= hi)


def _gate_band(
    ax: Axes, protocol: Protocol, metric: str, vertical: bool, data: list[float] | None = None
) -> None:
    """Green where a delta passes the gate, red where it fails (span sized to the data)."""
    lo, hi = _bounds(protocol, metric)
    if lo is None and hi is None:
        return
    known = [v for v in (lo, hi, 0.0, *(data or [])) if v is not None]
    reach = max(abs(v) for v in known) * 1.6 or 1.0
    span = ax.axvspan if vertical else ax.axhspan
    span(
        lo if lo is not None else -reach,
        hi if hi is not None else reach,
        color=GREEN,
        alpha=0.6,
        zorder=0,
        label="inside gate",
    )
    if hi is not None:
        span(hi, reach, color=RED, alpha=0.6, zorder=0, label="fails gate")
    if lo is not None:
        span(-reach, lo, color=RED, alpha=0.6, zorder=0)


def ladder_figure(rungs: list[Rung], path: Path, title: str) -> Path:
    """Horizontal bars in the run's own order from the top (stock first; a `--prefixes` run
    then reads as its cumulative ladder, p1, p2, ... down to the whole stack), each
    labelled with its speedups. Sorting by speed would scramble a ladder whose middle
    rungs tie (the H200 prefix ladder's p5..p7)."""
    plt = _pyplot()
    rungs = list(reversed(rungs))  # barh draws the first bar at the bottom
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rungs) + 1.5))
    colors = [PASS if r.exact else GREY for r in rungs]
    ax.barh([r.stack for r in rungs], [r.value for r in rungs], color=colors)
    ax.set_xscale("log")
    for i, r in enumerate(rungs):
        ratio = "S ratio" if r.metric == "S" else "RTF ratio (aggregate)"  # not the headline
        label = "  " + " · ".join(f"{ratio} {x:.2f}x vs {ref}" for ref, x in r.speedups.items())
        ax.text(r.value, i, label, va="center", fontsize=8)
    ax.set_xlabel(f"{rungs[0].metric} (log scale; lower is faster; grey: approximate)")
    ax.set_title(title)
    ax.set_xlim(right=max(r.value for r in rungs) * 12)  # room for the labels
    return _save(fig, path)


def throughput_figure(data: dict[str, dict[int, float]], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in data.items():
        sizes = list(points)
        ax.plot(sizes, [points[b] for b in sizes], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("utterances / s")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    _pyplot().close(fig)
    return path


# ------------------------------------------------------------------------------ render


def holdout_evaluations(store: Store, protocol: Protocol, workload: str) -> list[dict[str, Any]]:
    """Closed holdout audits under this protocol, with deltas recomputed from stored scores."""
    out = []
    for a in list_audits(store, workload):
        if (
            not a["run_id"]
            or a["status"] == "opened"
            or a["protocol_hash"] != (protocol.content_hash())
        ):
            continue
        result = store.get_result(a["run_id"])
        rows = load_rows(store, a["run_id"])
        if not rows:
            continue
        q = stack_quality(result, rows, protocol)
        stock = q[result.results[0].stack.name]
        cand = q.get(a["stack_name"])
        if cand is None:
            continue
        deltas = {m: cand.values[m] - stock.values[m] for m in cand.values if m in stock.values}
        out.append(
            {
                "run_id": a["run_id"],
                "stack": a["stack_name"],
                "when": a["opened_at"],
                "verdict": a["status"],
                "flagged": a["flagged"],
                "deltas": deltas,
                "meaningful": not random_weights(result.job.model),
            }
        )
    return out


def render_all(
    store: Store,
    protocol: Protocol,
    workload: str,
    out_dir: Path,
    model: ModelSpec | None = None,
    hardware: str | None = None,
    screen_run: str | None = None,
    ladder_run: str | None = None,
) -> dict[str, Any]:
    """Draw every figure that has data; returns (and writes) the manifest. The ladder is
    drawn from `ladder_run`, else from the newest finished run of the workload."""
    data = collect(store, protocol, workload, model, hardware)
    manifest: dict[str, Any] = {
        "generated_at": utcnow().isoformat(),
        "database": store.url,
        "protocol": data.protocol,
        "workload": workload,
        "hardware": data.hardware,
        "figures": {},
        "skipped": {},
    }
    runs = sorted({p.run_id for p in data.points})
    if data.points:
        frontier_figure(data, out_dir / "frontier.png")
        manifest["figures"]["frontier.png"] = {"runs": runs, "excluded": data.excluded}
        pareto_figure(data, out_dir / "pareto.png", protocol)
        manifest["figures"]["pareto.png"] = {"runs": runs, "metric": data.pareto_metric}
    else:
        manifest["skipped"]["frontier.png"] = "no experiments in scope under this protocol"
    evaluations = holdout_evaluations(store, protocol, workload)
    screen_run = screen_run or (evaluations[-1]["run_id"] if evaluations else None)
    if screen_run is None:
        scored = [p.run_id for p in data.points if p.deltas]
        screen_run = scored[-1] if scored else None
    if screen_run is not None:
        result = store.get_result(screen_run)
        quality = stack_quality(result, load_rows(store, screen_run), protocol)
        metrics = tuple(m for m in SCREEN_METRICS if m in protocol.quality.metrics)
        title = f"Quality screen · run {screen_run[:8]} ({result.job.workload.name})"
        meaningful = not random_weights(result.job.model)
        quality_screen_figure(quality, out_dir / "quality_screen.png", title, metrics, meaningful)
        manifest["figures"]["quality_screen.png"] = {
            "runs": [screen_run],
            "quality": "judged" if meaningful else NOT_MEANINGFUL,
        }
    else:
        manifest["skipped"]["quality_screen.png"] = "no scored run"
    if evaluations and protocol.quality.gates:
        holdout_deltas_figure(evaluations, protocol, out_dir / "holdout_deltas.png")
        manifest["figures"]["holdout_deltas.png"] = {"runs": [e["run_id"] for e in evaluations]}
    else:
        manifest["skipped"]["holdout_deltas.png"] = "no scored holdout evaluation"
    _serving_figures(store, workload, out_dir, data.hardware, manifest, ladder_run)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    return manifest


def _serving_figures(
    store: Store,
    workload: str,
    out_dir: Path,
    hardware: str | None,
    manifest: dict[str, Any],
    ladder_run: str | None = None,
) -> None:
    runs = [r["id"] for r in finished_runs(store, workload)]
    if ladder_run is not None and ladder_run not in runs:
        raise LookupError(f"run {ladder_run} is not a finished run of workload {workload!r}")
    run_id = ladder_run or (runs[-1] if runs else None)
    rungs = ladder(store.get_result(run_id)) if run_id else []
    if len(rungs) > 1:
        title = f"Ladder · run {run_id[:8]} · {workload}"
        ladder_figure(rungs, out_dir / "ladder.png", title)
        manifest["figures"]["ladder.png"] = {"runs": [run_id]}
    else:
        manifest["skipped"]["ladder.png"] = "no finished run with two stacks"
    data = throughput(store, workload, hardware)
    if any(len(points) > 1 for points in data.values()):
        throughput_figure(data, out_dir / "throughput.png", f"Serving throughput · {workload}")
        manifest["figures"]["throughput.png"] = {"paths": sorted(data)}
    else:
        manifest["skipped"]["throughput.png"] = "no serving path measured at two batch sizes"
