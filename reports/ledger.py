"""The failure ledger: every rejected or failed stack with its cause, as data and markdown.

Causes: slower (not faster than noise), gate (which quality gate, or holdout reuse), crash,
oom, compile, refused (a stack this device cannot run whole), interrupted. Rows come from
the store's failures table (written when runs are recorded and when decisions are made);
verdicts and champions come from their own tables. Regenerated from records, never edited.
Speedups are the headline stored with the runs (`speedup_paired` and its CI, as the gate
recorded it in the decision's evidence); a row of a noisy run says so.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.api.protocol import split_phase
from orchestrate.api.records import utcnow
from orchestrate.reports.tables import headline_cell, run_noise
from orchestrate.research.decide import list_champions, list_decisions
from orchestrate.running.metrics import headline_label

if TYPE_CHECKING:
    from orchestrate.store.store import Store

DETAIL_CHARS = 400


def entries(
    store: Store, cause: str | None = None, stack: str | None = None, limit: int = 1000
) -> list[dict[str, Any]]:
    """Failure-ledger entries, newest first, with the run's workload and protocol."""
    runs: dict[str, dict[str, Any] | None] = {}
    out = []
    for f in store.list_failures(limit=limit):
        if (cause and f["cause"] != cause) or (stack and f["stack_name"] != stack):
            continue
        run_id = f["run_id"]
        if run_id and run_id not in runs:
            runs[run_id] = store.get_run(run_id, utterances=False)
        run = runs.get(run_id) if run_id else None
        out.append(
            {
                **f,
                "workload": run["workload_name"] if run else None,
                "phase": split_phase(run["workload_name"])[1] if run else None,
                "protocol_version": run["protocol_version"] if run else None,
                "protocol_hash": run["protocol_hash"] if run else None,
                "noisy": run_noise(run) if run else [],
            }
        )
    return out


def _headline(decision: dict[str, Any] | None, speedup: float | None = None) -> str:
    """The decision's stored headline (its evidence), else the bare speedup it recorded."""
    stored = ((decision or {}).get("reasons") or {}).get("headline") or {}
    if stored:
        return headline_cell(stored)
    return "-" if speedup is None else f"{speedup:.2f}x"


def champion_rows(store: Store) -> list[dict[str, Any]]:
    """Champions, oldest first, each with `headline`: its stored speedup and CI."""
    decisions = {d["id"]: d for d in list_decisions(store)}
    return [
        {**c, "headline": _headline(decisions.get(c["decision_id"]), c["speedup"])}
        for c in list_champions(store)
    ]


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
            causes = d["reasons"].get("causes") or {}
            why = "; ".join(f"{k}: {v}" for k, v in causes.items()) or "every gate held"
            lines.append(
                f"| {_when(d['created_at'])} | {_cell(d['stack'])} | **{d['verdict']}** | "
                f"{_headline(d)} | {_cell(d['workload_name'])} | {_cell(d['hardware'])} | "
                f"{_cell(why)} |"
            )
    else:
        lines.append("No phase-gate decisions yet.")
    lines += ["", "## Champions (newest last)", ""]
    if champions:
        lines += [f"| since | model | workload | hardware | stack | {headline_label()} vs stock |"]
        lines += ["| --- " * 6 + "|"]
        by_id = {d["id"]: d for d in decisions}
        for c in champions:
            lines.append(
                f"| {_when(c['created_at'])} | {_cell(c['model'])} | {_cell(c['workload_name'])} "
                f"| {_cell(c['hardware'])} | {_cell(c['stack_name'])} | "
                f"{_headline(by_id.get(c['decision_id']), c['speedup'])} |"
            )
    else:
        lines.append("No champion yet: stock serves.")
    return "\n".join(lines) + "\n"


def write(store: Store, path: Path) -> Path:
    text = render(entries(store), list_decisions(store), list_champions(store))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
