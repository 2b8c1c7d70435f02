"""The failure ledger: every rejected or failed stack with its cause, as data and markdown.

Causes are facts: slower (the paired estimate is not above 1), below the noise bar (faster,
but the CI did not clear the protocol's min_speedup), gate (which quality gate, or holdout
reuse), oom (only when CUDA or the kernel's OOM killer said so), killed (signal N), crash,
compile, refused (a stack this device cannot run whole), interrupted. Rows come from the
store's failures table (written when runs are recorded and when decisions are made), each
cause re-read from its detail (store.decisions.ledger_cause); verdicts and champions come
from their own tables. Regenerated from records, never edited.

A decision's speedup is the headline stored with the run it was made on (`speedup_paired`
and its CI), labelled: a champion's is its holdout paired estimate, never the remeasure the
holdout was opened on. Flags a decision overrode are named, and on random weights its
quality says "not meaningful: random weights"; a row of a noisy run says so.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.api.protocol import split_phase
from orchestrate.api.records import utcnow
from orchestrate.reports.tables import headline_cell, run_noise
from orchestrate.research.decide import decision_view, list_champions, list_decisions
from orchestrate.running.metrics import headline_label
from orchestrate.store.decisions import ledger_cause

if TYPE_CHECKING:
    from orchestrate.store.store import Store

DETAIL_CHARS = 400


def entries(
    store: Store, cause: str | None = None, stack: str | None = None, limit: int = 1000
) -> list[dict[str, Any]]:
    """Failure-ledger entries, newest first, with the run's workload and protocol; `cause`
    is the fact (ledger_cause: `killed (signal 9)`, not a guessed `oom`), `stored_cause` the
    column's value. Filtering by `killed` matches every signal."""
    runs: dict[str, dict[str, Any] | None] = {}
    out = []
    for f in store.list_failures(limit=limit):
        fact = ledger_cause(f["cause"], f["detail"])
        if (cause and cause not in (fact, fact.split(" (")[0])) or (
            stack and f["stack_name"] != stack
        ):
            continue
        run_id = f["run_id"]
        if run_id and run_id not in runs:
            runs[run_id] = store.get_run(run_id, utterances=False)
        run = runs.get(run_id) if run_id else None
        out.append(
            {
                **f,
                "cause": fact,
                "stored_cause": f["cause"],
                "workload": run["workload_name"] if run else None,
                "phase": split_phase(run["workload_name"])[1] if run else None,
                "protocol_version": run["protocol_version"] if run else None,
                "protocol_hash": run["protocol_hash"] if run else None,
                "noisy": run_noise(run) if run else [],
            }
        )
    return out


def _headline(decision: dict[str, Any] | None, speedup: float | None = None) -> str:
    """The decision's headline, labelled (decision_rows' `view`: the stored paired estimate
    of the run it was made on); a bare decision row (no view) shows the headline of its
    evidence, else the speedup it recorded."""
    view = (decision or {}).get("view") or {}
    if view.get("headline"):
        return f"{headline_cell(view['headline'])} ({view['headline']['label']})"
    stored = ((decision or {}).get("reasons") or {}).get("headline") or {}
    if stored:
        return headline_cell(stored)
    return "-" if speedup is None else f"{speedup:.2f}x"


def decision_rows(store: Store, workload: str | None = None) -> list[dict[str, Any]]:
    """Decisions, oldest first, each with `view` (research.decide.decision_view): its
    labelled headline, the flags it overrode, whether quality was judged, and why."""
    return [{**d, "view": decision_view(store, d)} for d in list_decisions(store, workload)]


def champion_rows(store: Store) -> list[dict[str, Any]]:
    """Champions, oldest first, each with `headline` (its holdout paired estimate and CI,
    labelled) and the flags its decision `overridden`."""
    decisions = {d["id"]: d for d in decision_rows(store)}
    out = []
    for c in list_champions(store):
        d = decisions.get(c["decision_id"])
        view = (d or {}).get("view") or {}
        out.append(
            {
                **c,
                "headline": _headline(d, c["speedup"]),
                "overridden": view.get("overridden", []),
                "quality": view.get("quality", "judged"),
            }
        )
    return out


def _cell(text: Any, limit: int = DETAIL_CHARS) -> str:
    s = "" if text is None else str(text)
    s = " ".join(s.split()).replace("|", "\\|")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _when(t: datetime | None) -> str:
    return "" if t is None else f"{t:%Y-%m-%d %H:%M}"


def render(
    failures: list[dict[str, Any]],
    decisions: list[dict[str, Any]],
    champions: list[dict[str, Any]],
    generated_at: datetime | None = None,
) -> str:
    lines = [
        "# Failure ledger",
        "",
        f"Generated from the run database at {_when(generated_at or utcnow())} UTC by "
        "`orchestrate ledger --write`. Do not edit: regenerate.",
        "Failed ideas are results: reopen one only with a new mechanism.",
        "",
        "## Rejected and failed stacks",
        "",
    ]
    if failures:
        lines += [
            "| when | stack | cause | workload | protocol | run | detail |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for f in failures:
            proto = f"v{f['protocol_version']}" if f["protocol_version"] is not None else ""
            lines.append(
                f"| {_when(f['created_at'])} | {_cell(f['stack_name'] or '(whole run)')} | "
                f"{f['cause']} | {_cell(f['workload'])} | {proto} | "
                f"{(f['run_id'] or '')[:8]}{' (noisy)' if f.get('noisy') else ''} | "
                f"{_cell(f['detail'])} |"
            )
    else:
        lines.append("No failures recorded.")
    lines += ["", "## Decisions", ""]
    if decisions:
        lines += [
            f"| when | stack | verdict | {headline_label()} vs stock | workload | hardware | why |",
            "| --- " * 7 + "|",
        ]
        for d in decisions:
            why = (d.get("view") or {}).get("why")
            if why is None:  # a bare row: its causes, and nothing claimed beyond them
                causes = d["reasons"].get("causes") or {}
                why = "; ".join(f"{k}: {v}" for k, v in causes.items()) or "no cause recorded"
            lines.append(
                f"| {_when(d['created_at'])} | {_cell(d['stack'])} | **{d['verdict']}** | "
                f"{_headline(d)} | {_cell(d['workload_name'])} | {_cell(d['hardware'])} | "
                f"{_cell(why)} |"
            )
    else:
        lines.append("No phase-gate decisions yet.")
    lines += ["", "## Champions (newest last)", ""]
    if champions:
        lines += [
            f"| since | model | workload | hardware | stack | {headline_label()} vs stock "
            "| overridden |"
        ]
        lines += ["| --- " * 7 + "|"]
        by_id = {d["id"]: d for d in decisions}
        for c in champions:
            d = by_id.get(c["decision_id"])
            overridden = ((d or {}).get("view") or {}).get("overridden") or []
            lines.append(
                f"| {_when(c['created_at'])} | {_cell(c['model'])} | {_cell(c['workload_name'])} "
                f"| {_cell(c['hardware'])} | {_cell(c['stack_name'])} | "
                f"{_headline(d, c['speedup'])} | {_cell('; '.join(overridden) or 'none')} |"
            )
    else:
        lines.append("No champion yet: stock serves.")
    return "\n".join(lines) + "\n"


def write(store: Store, path: Path) -> Path:
    text = render(entries(store), decision_rows(store), list_champions(store))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
