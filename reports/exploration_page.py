"""One exploration as a self-contained static HTML page (`orchestrate report EXPLORATION`).

The page holds the tree of tried stacks with their decisions, the frontier over time, the
champion's ladder, the ledger and a listening pack (the root's and the champion's audio per
development prompt). Figures and WAVs are embedded (base64), so the one file can be mailed
or attached to an issue. Holdout prompts never appear: the listening pack reads only the
exploration's development runs, and labels clips by prompt id and seed.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.api.config import ModelSpec, without_pydantic_detail
from orchestrate.api.registry import get_family
from orchestrate.reports.embed import new_figure, png_base64, write_page
from orchestrate.reports.listening import LEVEL_NOTE, UnreadableClip, listening_clip

if TYPE_CHECKING:
    from orchestrate.store.store import Store

COLOURS = {"accept": "#1b5e20", "retain": "#b71c1c", "invalid": "#b71c1c", "error": "#b71c1c"}


@dataclass
class Node:
    """One candidate of the exploration, as the page shows it."""

    id: int
    parent_id: int | None
    change: str
    proposer: str
    decision: str
    reason: str
    headline: float | None = None  # paired speedup against the root (stock)
    lo: float | None = None
    hi: float | None = None
    children: list[Node] = field(default_factory=list)


@dataclass
class Clip:
    label: str  # "en01 · seed 42"
    reference: str  # base64 WAV of the root stack
    champion: str  # base64 WAV of the champion
    flags: list[str] = field(default_factory=list)  # clipping, non-finite samples as generated


@dataclass
class ExplorationView:
    id: str
    family: str
    model: str
    device: str
    workload: str
    root: str
    baseline: str  # the family's stock: every headline and the listening pack are against it
    status: str
    stop_reason: str | None
    champion: str
    champion_headline: float | None
    champion_lo: float | None
    champion_hi: float | None
    headline_label: str
    nodes: list[Node]
    ladder: list[tuple[str, float]]  # the champion's accepted steps: (change, headline)
    listening: list[Clip] = field(default_factory=list)
    listening_notes: list[str] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)
    root_headline: float | None = None  # the root's paired speedup vs stock, if measured
    environment: list[tuple[str, str]] = field(default_factory=list)  # of its newest run
    frontier_png: str | None = None
    ladder_png: str | None = None

    @property
    def tree(self) -> list[Node]:
        """The candidates as a forest under the root (parent None = the root)."""
        by_id = {n.id: n for n in self.nodes}
        for n in self.nodes:
            n.children = []
        roots = []
        for n in self.nodes:
            parent = by_id.get(n.parent_id) if n.parent_id is not None else None
            (parent.children if parent else roots).append(n)
        return roots


def render(view: ExplorationView, out: Path) -> Path:
    """Draw the figures into `view` and write the page to `out`."""
    view.frontier_png = _png(_frontier_figure, view) if _measured(view) else None
    view.ladder_png = _png(_ladder_figure, view) if view.ladder else None
    return write_page("exploration.html.j2", out, v=view)


def save_figures(view: ExplorationView, folder: Path, stem: str) -> list[Path]:
    """The page's figures (drawn by `render`) as PNG files too, for a README or a record."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, png in (("frontier", view.frontier_png), ("ladder", view.ladder_png)):
        if png:
            path = folder / f"{stem}-{name}.png"
            path.write_bytes(base64.b64decode(png))
            out.append(path)
    return out


def _measured(view: ExplorationView) -> list[Node]:
    return [n for n in view.nodes if n.headline is not None]


def _png(draw: Any, view: ExplorationView) -> str:
    fig, ax = new_figure((8, 3.6))
    draw(ax, view)
    return png_base64(fig, dpi=110)


def _frontier_figure(ax: Any, view: ExplorationView) -> None:
    """Each measured candidate in the order tried (its CI as a bar, coloured by decision,
    labelled with its change), and the champion's standing after it: from the root's own
    headline when known (1.0 when it is stock)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

    best = 1.0 if view.root == view.baseline else view.root_headline
    xs, steps, seen = [], [], set()
    for i, n in enumerate(view.nodes, 1):
        if n.headline is not None:
            colour = COLOURS.get(n.decision, "#9e9e9e")
            seen.add(n.decision if n.decision in COLOURS else "other")
            if n.lo is not None and n.hi is not None:
                ax.vlines(i, n.lo, n.hi, color=colour, lw=1, alpha=0.6)
            ax.scatter(i, n.headline, color=colour, s=22, zorder=3)
            # slanted: candidates of one round sit at about the same height side by side
            ax.annotate(_short(i, n.change), (i, n.headline), xytext=(3, 3), rotation=35,
                        textcoords="offset points", fontsize=7, color="#424242")  # fmt: skip
        if n.decision == "accept" and n.headline is not None:
            best = n.headline
        if best is not None:
            xs.append(i)
            steps.append(best)
    handles = []
    if xs:
        ax.step(xs, steps, where="post", color="#1b5e20", lw=1.5)
        handles.append(Line2D([], [], color="#1b5e20", lw=1.5, label="champion"))
    for label, colour in (("accepted", "#1b5e20"), ("retained, invalid or failed", "#b71c1c"),
                          ("not accepted", "#9e9e9e")):  # fmt: skip
        key = {"accepted": "accept", "not accepted": "other"}.get(label)
        if key in seen or (key is None and seen & {"retain", "invalid", "error"}):
            handles.append(Line2D([], [], ls="", marker="o", color=colour, label=label))
    # outside the axes: inside, it hid the labels of early candidates
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.axhline(1.0, color="#9e9e9e", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6))  # a few plain ticks: 1.2x, not 10^0
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}x"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(0.5, len(view.nodes) + 1.5)  # room for the last label
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("candidate (order tried); bars: 95% CI")
    ax.set_ylabel(f"{view.headline_label}\n(log)", fontsize=8)


def _short(i: int, change: str) -> str:
    """`#i` and the change without what came along or its parameters ("+graph_loop (with
    static_kv_cache, device_sampler)" -> "#3 +graph_loop", "+num_step(value=23),
    +t_shift(value=0.71)" -> "#11 +num_step, +t_shift"): full labels overran each other and
    the axes; the page's tree beside the figure has each change whole."""
    return f"#{i} " + re.sub(r" ?\([^)]*\)", "", change)


def _ladder_figure(ax: Any, view: ExplorationView) -> None:
    first = 1.0 if view.root == view.baseline else view.root_headline
    labels = [*([view.root] if first else []), *(c for c, _ in view.ladder)]
    values = [*([first] if first else []), *(h for _, h in view.ladder)]
    ax.barh(range(len(values)), values, color="#1f5fa8")
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f}x", va="center", fontsize=8)
    ax.set_xlabel(view.headline_label)


# ------------------------------------------------------------------- from the store


def view_from_store(store: Store, exploration: str, baseline: str) -> ExplorationView:
    """The page's data for one exploration. `baseline`: the family's stock stack name,
    which every fresh and gate job holds and the listening pack compares the champion with."""
    row = store.get_exploration(exploration)
    cands = row["candidates"]
    accepted = {c["stack_hash"]: c for c in cands if c["decision"] == "accept"}
    nodes = [
        Node(
            id=c["seq"],
            parent_id=accepted[c["parent_hash"]]["seq"] if c["parent_hash"] in accepted else None,
            change=c["change"],
            proposer=c["proposer"],
            decision=c["decision"] or c["status"],
            reason=without_pydantic_detail(c["reason"] or c["proposal_reason"] or ""),
            headline=c["headline"],
            lo=c["headline_lo"],
            hi=c["headline_hi"],
        )
        for c in cands
    ]
    ladder = [(c["change"], c["headline"]) for c in cands if c["decision"] == "accept"]
    champion = row["champion"]["name"]
    clips, notes = _listening(store, cands, champion, baseline)
    caveats = []
    spec = ModelSpec.model_validate(row["model"])
    if get_family(row["family"]).random_weights(spec):
        caveats.append(
            "Random weights: speed and fidelity are measured; quality (WER, MOS, SIM) is not "
            "meaningful, and the listening pack shows what the stacks computed, not speech."
        )
    return ExplorationView(
        id=row["id"],
        family=row["family"],
        model=spec.weights or spec.preset,
        device=spec.device,
        workload=row["workload_name"],
        root=row["root"]["name"],
        baseline=baseline,
        status=row["status"],
        stop_reason=row["stop_reason"],
        champion=champion,
        champion_headline=row["champion_headline"],
        champion_lo=row["champion_lo"],
        champion_hi=row["champion_hi"],
        headline_label=f"speedup vs {baseline} (paired, 95% CI)",
        nodes=nodes,
        ladder=[(c, h) for c, h in ladder if h is not None],
        listening=clips,
        listening_notes=notes,
        caveats=caveats,
        # Before any accept the champion is the root, so its headline is the root's.
        root_headline=None if ladder else row["champion_headline"],
        environment=_environment(store, cands),
    )


def _environment(store: Store, cands: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Where the exploration ran: its newest run's device, host, versions, date and commit."""
    from orchestrate.reports.run_page import environment_rows

    for run_id in reversed([r for c in cands for r in c["run_ids"]]):
        try:
            row = store.get_run(run_id, utterances=False)
        except LookupError:
            continue
        if row.get("environment"):
            return [("from run", run_id[:12]), *environment_rows(row, row["environment"])]
    return []


def _listening(
    store: Store, cands: list[dict[str, Any]], champion: str, baseline: str
) -> tuple[list[Clip], list[str]]:
    """Stock's and the champion's recordings of each development utterance, from the
    newest run that holds both with audio saved (the champion's own dev or fresh job)."""
    from orchestrate.research.scoring_run import audio_root

    runs = [r for c in reversed(cands) if c["decision"] == "accept" for r in reversed(c["run_ids"])]
    unreadable: list[str] = []
    for run_id in runs:
        try:
            result = store.get_result(run_id)
        except LookupError:
            continue
        if result is None or result.job.sealed_file is not None:  # never a holdout clip
            continue
        by = {r.stack.name: r for r in result.results}
        if baseline not in by or champion not in by:
            continue
        root = audio_root(result)
        clips = []
        for a, b in zip(by[baseline].utterances, by[champion].utterances, strict=False):
            pa = root / a.audio_path if a.audio_path else None
            pb = root / b.audio_path if b.audio_path else None
            if pa and pb and pa.is_file() and pb.is_file():
                label = f"{a.prompt_id} · seed {a.seed}"
                try:
                    ca, cb = listening_clip(pa), listening_clip(pb)
                except UnreadableClip as exc:  # one bad file costs its row, not the page
                    unreadable.append(str(exc))
                    continue
                pairs = ((baseline, ca), (champion, cb))
                flags = [f"{label} · {name}: {f}" for name, c in pairs for f in c.flags]
                clips.append(Clip(label, ca.wav_base64, cb.wav_base64, flags))
        if clips:
            return clips, [f"From run {run_id[:12]}.", LEVEL_NOTE, *unreadable]
    if not runs:
        return [], ["No accepted candidate: the champion is the root, nothing to compare."]
    if unreadable:
        return [], ["The champion's recordings could not be read:", *unreadable]
    return [], ["The champion's runs kept no recordings on this machine (WAVs not copied)."]
