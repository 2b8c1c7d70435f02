"""One run as a self-contained static HTML page (`orchestrate report RUN`).

What a researcher attaches to a pull request: the settings, the environment (device, host
CPU, versions, date, commit) and protocol; the stacks table with the same cells as
`orchestrate show` (`tables.stack_cells`: one definition of every figure); each stack's
fidelity and quality and what they cover; the headline figure; and a listening pack: per
prompt, every stack's recording side by side (`listening.py`: 16-bit PCM, level-set, clipping
flagged, a spectrogram), with the transcript and WER where a scorer ran. A holdout run's
page shows neither its texts nor its clips.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.api.config import ModelSpec
from orchestrate.api.registry import get_family
from orchestrate.reports.embed import new_figure, png_base64, write_page
from orchestrate.reports.listening import (
    LEVEL_NOTE,
    ListeningClip,
    UnreadableClip,
    listening_clip,
)
from orchestrate.running.metrics import HEADLINE, invalid_reasons
from orchestrate.store.errors import StoreError

if TYPE_CHECKING:
    from orchestrate.api.records import ResultRecord
    from orchestrate.store.store import Store

# Per-utterance score values shown beside a clip (the rest stay in `orchestrate scores`).
CLIP_SCORES = ("wer", "cer", "mos", "sim")


@dataclass
class StackClip:
    stack: str
    clip: ListeningClip | None  # None: no recording kept, or `problem` says why not shown
    transcript: str | None = None
    scores: dict[str, float] = field(default_factory=dict)
    problem: str | None = None  # a recording that could not be read


@dataclass
class Utterance:
    label: str  # "en01 · seed 42"
    text: str
    clips: list[StackClip]


@dataclass
class RunView:
    id: str
    title: str
    status: str
    noisy: list[str]
    settings: list[tuple[str, str]]
    environment: list[tuple[str, str]]
    protocol: list[tuple[str, str]]
    headers: list[str]
    rows: list[list[str]]
    table_note: str  # what the table's figures are (tables.table_note)
    # a serving run's phases and memory per stack (tables.serving_detail), else None
    serving_detail: tuple[list[str], list[list[str]], str] | None
    notes: list[str]  # skipped techniques, warnings, errors: under the table
    fidelity: list[str]
    quality: list[str]
    caveats: list[str]
    headline_png: str | None = None
    listening: list[Utterance] = field(default_factory=list)
    listening_notes: list[str] = field(default_factory=list)

    @property
    def stacks(self) -> list[str]:
        return [c.stack for c in self.listening[0].clips] if self.listening else []


def render(view: RunView, out: Path) -> Path:
    return write_page("run.html.j2", out, v=view, level_note=LEVEL_NOTE)


def view_from_store(store: Store, run_id: str) -> RunView:
    from orchestrate.reports import tables

    row = tables.annotate(store.get_run(run_id))
    env = row.get("environment") or {}
    job = row.get("job") or {}
    protocol = job.get("protocol") or {}
    confidence = (protocol.get("speed") or {}).get("confidence", 0.95)
    headers, rows = tables.stack_cells(row["stacks"], confidence)
    notes = tables.skipped_lines(row["stacks"])
    notes += [w for s in row["stacks"] for w in s["warnings"]]
    notes += [f"{s['name']}: {s['error']}" for s in row["stacks"] if s.get("error")]
    if row.get("error"):
        notes.insert(0, f"run error: {tables.error_line(row['error'])}")
    spec = ModelSpec.model_validate(row["model"])
    random = _random_weights(row["family"], spec)
    caveats = []
    if random:
        caveats.append(
            "Random weights: speed and fidelity are measured; quality (WER, MOS, SIM) is not "
            "meaningful, and the listening pack shows what the stacks computed, not speech."
        )
    if row["noisy"]:
        caveats.append("NOISY run: its speedups are not to be trusted (reasons below the table).")
    device = env.get("device_name") or spec.device
    scores = store.list_scores(row["id"])
    view = RunView(
        id=row["id"],
        title=f"run {row['id'][:12]} · {row['workload_name']} · {device}",
        status=row["status"],
        noisy=row["noisy"],
        settings=_settings(row, spec),
        environment=environment_rows(row, env),
        protocol=_protocol(row, protocol),
        headers=headers,
        rows=rows,
        table_note=tables.table_note(row["stacks"]),
        serving_detail=tables.serving_detail(row["stacks"]),
        notes=notes,
        fidelity=_fidelity(row),
        quality=_quality(scores, random),
        caveats=caveats,
    )
    view.headline_png = _headline_png(row, confidence, spec, device)
    try:
        result = store.get_result(row["id"])
    except StoreError:  # a failed or interrupted run recorded no result
        result = None
    if result is None:
        view.listening_notes = ["The run has no recorded result: nothing to listen to."]
    elif result.job.sealed_file is not None:
        view.listening_notes = ["A holdout run: its prompts and recordings stay sealed."]
    else:
        view.listening, view.listening_notes = _listening(row, result, scores)
    return view


def _random_weights(family: str, spec: ModelSpec) -> bool:
    try:
        return bool(get_family(family).random_weights(spec))
    except Exception:  # a family not installed here: say nothing rather than guess
        return False


def _settings(row: dict[str, Any], spec: ModelSpec) -> list[tuple[str, str]]:
    wl = row.get("workload") or {}
    policy = wl.get("length_policy") or {}
    stacks = []
    for s in row["stacks"]:
        techniques = [t["name"] for t in (s.get("spec") or {}).get("techniques", [])]
        stacks.append(f"{s['name']} ({', '.join(techniques) or 'no technique'})")
    return [
        ("family", row["family"]),
        ("model", f"{spec.weights or spec.preset} · {spec.dtype} · {spec.device}"),
        (
            "workload",
            f"{row['workload_name']}: {len(wl.get('prompts', []))} prompts × "
            f"seeds {wl.get('seeds')} · warm-ups {wl.get('warmups')}",
        ),
        ("length policy", ", ".join(f"{k} {v}" for k, v in policy.items() if v is not None)),
        ("stacks (baseline first)", "; ".join(stacks)),
        ("status", row["status"]),
    ]


def environment_rows(row: dict[str, Any], env: dict[str, Any]) -> list[tuple[str, str]]:
    from orchestrate.reports.tables import host_line

    gpu = [env.get("device_name") or "?"]
    if env.get("driver"):
        gpu.append(f"driver {env['driver']}")
    if env.get("sm_clock_mhz"):
        gpu.append(
            f"SM {env['sm_clock_mhz']:.0f} MHz, memory {env.get('mem_clock_mhz') or 0:.0f} MHz"
        )
    sha = row.get("code_sha") or env.get("git_sha") or "unknown"
    dirty = (row.get("job") or {}).get("code_dirty") or env.get("git_dirty")
    versions = [f"python {env.get('python', '?')}", f"torch {env.get('torch', '?')}"]
    versions += [f"transformers {env['transformers']}"] if env.get("transformers") else []
    versions += [f"CUDA {env['cuda']}"] if env.get("cuda") else []
    versions += [f"{k} {v}" for k, v in sorted((env.get("packages") or {}).items())]
    return [
        ("device", " · ".join(gpu)),
        ("host", host_line(env)),
        ("versions", ", ".join(versions)),
        ("date", f"{row.get('started_at')} to {row.get('ended_at')} (UTC)"),
        ("commit", f"{sha}{' with uncommitted changes' if dirty else ''}"),
        ("host name", str(env.get("hostname") or row.get("host") or "?")),
    ]


def _protocol(row: dict[str, Any], protocol: dict[str, Any]) -> list[tuple[str, str]]:
    out = [("protocol", f"{row.get('protocol_hash')} (version {row.get('protocol_version')})")]
    for section, values in protocol.items():
        if isinstance(values, dict):
            shown = ", ".join(f"{k} {v}" for k, v in values.items() if not isinstance(v, dict))
            out.append((section, shown or "-"))
        else:
            out.append((section, str(values)))
    return out


def _fidelity(row: dict[str, Any]) -> list[str]:
    from orchestrate.reports.tables import fidelity_scope, fidelity_verdict, slot_checks_line

    lines = []
    for s in row["stacks"]:
        fid = s.get("fidelity")
        if not fid or not (s["position"] > 0 or s.get("applied")):
            continue  # stock against itself says nothing
        lines.append(
            f"{s['name']}: {fidelity_verdict(fid)} over {fid['steps']} steps; mean KL "
            f"{fid['mean_kl']:.3g}, top-1 agreement {fid['top1_agreement']:.3f}, top-k overlap "
            f"{fid['topk_agreement']:.3f} (measured: {s['exactness']})"
        )
        if extra := slot_checks_line(s["name"], fid):
            lines.append(extra)
    if lines:
        lines.insert(0, fidelity_scope(row.get("family")))
    return lines or ["No stack ran a fidelity comparison (a stock-only run, or none recorded)."]


def _quality(all_scores: list[dict[str, Any]], random: bool) -> list[str]:
    scores = [r for r in all_scores if r["status"] == "ok"]
    if not scores:
        return ["Not scored: `orchestrate score RUN` runs the quality scorers on the recordings."]
    by: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in scores:
        key = (r["stack"], f"{r['scorer']} {r['scorer_version']} ({r['weights_id']})")
        for metric, value in r["values"].items():
            if isinstance(value, int | float):
                by.setdefault(key, {}).setdefault(metric, []).append(float(value))
    lines = [
        f"{stack} · {scorer}: "
        + ", ".join(f"{m} mean {sum(v) / len(v):.3g} (n = {len(v)})" for m, v in metrics.items())
        for (stack, scorer), metrics in by.items()
    ]
    if random:
        lines.append("These scores are of random-weight audio: they say nothing about speech.")
    return lines


def _headline_png(
    row: dict[str, Any], confidence: float, spec: ModelSpec, device: str
) -> str | None:
    """Each stack's paired headline against the baseline with its CI, bars from zero."""
    points = []
    for s in row["stacks"][1:]:
        m = s.get("metrics") or {}
        if HEADLINE in m and not invalid_reasons(m, s.get("invalid_reason")):
            points.append(
                (s["name"], m[HEADLINE], m.get(f"{HEADLINE}_lo"), m.get(f"{HEADLINE}_hi"))
            )
    if not points:
        return None
    fig, ax = new_figure((8, 0.5 * len(points) + 1.6))
    names = [p[0] for p in reversed(points)]
    values = [p[1] for p in reversed(points)]
    ax.barh(names, values, color="#1f5fa8")
    for i, (_, v, lo, hi) in enumerate(reversed(points)):
        if lo is not None and hi is not None:
            ax.errorbar(v, i, xerr=[[v - lo], [hi - v]], color="black", capsize=3, lw=1)
        ax.text(max(v, hi or v), i, f"  {v:.2f}x", va="center", fontsize=8)
    ax.axvline(1.0, color="#9e9e9e", lw=0.8, ls="--")
    ax.set_xlim(0, max(p[3] or p[1] for p in points) * 1.2)  # room for the labels
    ax.set_xlabel(f"speedup vs {row['stacks'][0]['name']} (paired, {confidence:.0%} CI); 1x dashed")
    ax.set_title(
        f"{spec.weights or spec.preset} · {device} · {row['workload_name']} · run {row['id'][:12]}",
        fontsize=9,
    )
    return png_base64(fig, dpi=110)


def _listening(
    row: dict[str, Any], result: ResultRecord, scores: list[dict[str, Any]]
) -> tuple[list[Utterance], list[str]]:
    """Every (prompt, seed) with a recording in some stack, each stack's side by side."""
    from orchestrate.research.scoring_run import audio_root

    root = audio_root(result, row.get("result_path"))
    texts = {p.id: p.text for p in result.job.workload.prompts}
    # Every scorer of an utterance: WER and a transcript from one, MOS or SIM from another.
    values: dict[tuple[str, str, int], dict[str, float]] = {}
    heard: dict[tuple[str, str, int], str] = {}
    for r in scores:
        if r["status"] != "ok":
            continue
        key = (r["stack"], r["prompt_id"], r["seed"])
        got = {k: float(v) for k, v in r["values"].items() if k in CLIP_SCORES}
        values.setdefault(key, {}).update(got)
        if transcript := (r.get("details") or {}).get("transcript"):
            heard[key] = transcript
    keys: list[tuple[str, int]] = []
    paths: dict[tuple[str, str, int], Path] = {}
    for r in result.results:
        for u in r.utterances:
            path = root / u.audio_path if u.audio_path else None
            if path is not None and path.is_file():
                paths.setdefault((r.stack.name, u.prompt_id, u.seed), path)
                if (u.prompt_id, u.seed) not in keys:
                    keys.append((u.prompt_id, u.seed))
    if not keys:
        saved = any(u.audio_path for r in result.results for u in r.utterances)
        why = "its WAVs are not on this machine" if saved else "the workload saved no audio"
        return [], [f"No recordings to play: {why} ({root})."]
    out = []
    for prompt, seed in keys:
        clips = []
        for r in result.results:
            key = (r.stack.name, prompt, seed)
            path = paths.get(key)
            clip, problem = None, None
            if path is not None:
                try:
                    clip = listening_clip(path)
                except UnreadableClip as exc:
                    problem = str(exc)
            clips.append(
                StackClip(r.stack.name, clip, heard.get(key), values.get(key, {}), problem)
            )
        out.append(Utterance(f"{prompt} · seed {seed}", texts.get(prompt, ""), clips))
    return out, [f"Recordings from {root}."]
