"""Terminal tables for runs and comparisons (rich)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table

from orchestrate.running.metrics import (
    AGGREGATE,
    AGGREGATE_LABEL,
    EXACT_CELL,
    FIDELITY_FAILED,
    HEADLINE,
    SAME_AUDIO,
    SAME_AUDIO_ROUNDS,
    exactness,
    headline_label,
    invalid_reasons,
    noise_reasons,
)
from orchestrate.running.metrics import run_noise as metrics_run_noise

if TYPE_CHECKING:
    from orchestrate.reports.run_diff import RunDiff

COLUMNS = [
    ("median_latency_s", "median s", "{:.3f}"),
    ("p95_latency_s", "p95 s", "{:.3f}"),
    ("rtf", "RTF", "{:.4f}"),
    ("audio_s_per_compute_s", "audio s/s", "{:.2f}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("ms_per_token", "ms/tok", "{:.2f}"),
    # GPU runs only: the union of device activity per token; far below ms/tok = host-bound
    ("gpu_busy_ms_per_step", "GPU-busy ms/tok", "{:.2f}"),
    ("achieved_gb_s", "GB/s", "{:.0f}"),
    ("fraction_of_floor", "of floor", "{:.0%}"),
    # GPU runs only (running/gpu_memory.py): model + its engine + its timed transient
    ("gpu_needed_gb", "GPU GB needed", "{:.2f}"),
    (HEADLINE, "speedup", ""),  # header and cell: headline_label, headline_cell
    (AGGREGATE, AGGREGATE_LABEL, "{:.2f}x"),
]
# A serving workload's figures (running/serving.py DEFINITIONS): per stream, not per utterance.
SERVING_COLUMNS = [
    ("serve.streams", "streams", "{:.0f}"),
    ("serve.served", "served (no late chunk)", "{:.0f}"),
    ("serve.behind", "behind", "{:.0f}"),
    ("serve.incomplete", "incomplete", "{:.0f}"),
    ("serve.ttfa_p50_s", "first audio p50 s", "{:.3f}"),
    ("serve.ttfa_p95_s", "first audio p95 s", "{:.3f}"),
    ("serve.ttfa_p99_s", "first audio p99 s", "{:.3f}"),
    ("serve.rtf_p95", "stream RTF p95", "{:.3f}"),
    ("serve.audio_s_per_s", "audio s/s (all streams)", "{:.2f}"),
]
# What a fidelity figure covers, unless the family says (a `fidelity_covers` attribute):
# the teacher-forced pass runs the model's step (decoder, projections, attention, head),
# never the sampler or the generation loop; those get tests of their own only where a
# technique fills them (each record's `covers` says which ran), so the run-level line says so.
UNCOVERED_SLOTS = ("sampler", "loop")


class ReadableTable(Table):
    """A table that wraps instead of cutting: at any width, columns are narrowed widest
    first down to their longest word, so headers and reasons wrap between words and no
    cell is cut with an ellipsis (rich's own narrowing cuts the widest columns first, a
    reason or the headline before a number). Light rules: a 14-column run table then fits
    120 columns. Where even the longest words do not fit, the longest fold (nothing lost)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs = {"box": box.SIMPLE_HEAD, "pad_edge": False, "collapse_padding": True} | kwargs
        super().__init__(*args, **kwargs)

    def add_column(self, *args: Any, **kwargs: Any) -> None:
        super().add_column(*args, **({"overflow": "fold"} | kwargs))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        self._fit(console, options.update_width(options.max_width - self._extra_width))
        yield from super().__rich_console__(console, options)

    def _fit(self, console: Console, options: ConsoleOptions) -> None:
        for column in self.columns:  # measured afresh at each width
            column.width = None
        ranges = [self._measure_column(console, options, c) for c in self.columns]
        widths, floors = [r.maximum for r in ranges], [r.minimum for r in ranges]
        excess = sum(widths) - options.max_width
        while excess > 0:
            # Down to the longest words first; then, if those do not fit either, the
            # longest words fold, widest first (a long stack name before a number).
            i = max(range(len(widths)), key=lambda j: (widths[j] > floors[j], widths[j]))
            if widths[i] <= 3:
                return  # nothing sensible fits: rich's own narrowing
            widths[i], excess = widths[i] - 1, excess - 1
        for i, column in enumerate(self.columns):
            column.width = widths[i] - self._get_padding_width(i)


def headline_cell(m: Mapping[str, float], suffix: str = "") -> str:
    """The stored headline as printed everywhere: `1.82x [1.70, 1.95]`."""
    point = m.get(HEADLINE + suffix)
    if point is None:
        return "-"
    lo, hi = m.get(f"{HEADLINE}_lo{suffix}"), m.get(f"{HEADLINE}_hi{suffix}")
    return f"{point:.2f}x" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "")


def stack_exactness(s: Mapping[str, Any]) -> str:
    """A stored stack's (get_run row) measured exactness: metrics.exactness."""
    fid = s.get("fidelity")
    within = None if not fid else bool(fid["within_tolerance"])
    return exactness(bool(s.get("exact", True)), within, _techniques(s))


def exact_cell(s: Mapping[str, Any]) -> str:
    """The `exact` column: the measured verdict, and `partly unmeasured` where fidelity
    never ran some slot the stack's techniques fill (a sampler, a loop)."""
    verdict = stack_exactness(s)
    if verdict == "exact" and ((s.get("fidelity") or {}).get("not_covered")):
        return "yes (partly unmeasured)"
    return EXACT_CELL[verdict]


def run_noise(run_row: Mapping[str, Any]) -> list[str]:
    """Why a stored run's figures are not to be trusted (metrics.run_noise), or []."""
    return metrics_run_noise([(s["name"], s["metrics"]) for s in run_row.get("stacks", [])])


def annotate(run_row: dict[str, Any]) -> dict[str, Any]:
    """A get_run row with the verdicts `show --json` carries: per stack `exactness`
    (exact, failed, unmeasured, approximate), `invalid` reasons ([]: none) and `warnings`
    (what its record lacks or flags), and the run's `noisy` reasons ([]: clean)."""
    _record_fields(run_row)
    for s in run_row.get("stacks", []):
        s["exactness"] = stack_exactness(s)
        s["invalid"] = invalid_reasons(s.get("metrics", {}), s.get("invalid_reason"))
        s["warnings"] = stack_warnings(s)
    run_row["noisy"] = run_noise(run_row)
    return run_row


def _record_fields(run_row: dict[str, Any]) -> None:
    """Copy the guard fields the store has no column for (the fidelity error's text, the
    invalid reason, the same-audio pair) from the run's result record, where it is still on
    disk; without it, the stored metrics still carry each verdict."""
    from orchestrate.api.records import ResultRecord

    try:
        record = ResultRecord.read(Path(run_row["result_path"]))
    except Exception:  # no path, moved, or another schema: the metrics answer alone
        return
    if record.job.job_id != run_row.get("job_id"):
        return  # a folder reused since: another run's record
    by_name = {r.stack.name: r for r in record.results}
    for s in run_row.get("stacks", []):
        if (r := by_name.get(s["name"])) is not None:
            s.setdefault("fidelity_error", r.fidelity_error)
            s.setdefault("invalid_reason", r.invalid)
            same = r.audio_independent_of_input
            s.setdefault("audio_independent_of_input", same and same.model_dump())


def stack_warnings(s: Mapping[str, Any]) -> list[str]:
    """What a stored stack's numbers rest on that is missing or suspect, one line each:
    timings faster than their floor, audio that ignores its input, fidelity that failed,
    was not measured, or never ran some of the slots its techniques fill."""
    m, name = s.get("metrics") or {}, s["name"]
    out = [f"{name}: INVALID: {r}" for r in invalid_reasons(m, s.get("invalid_reason"))]
    if m.get(SAME_AUDIO):
        out.append(f"{name}: audio independent of input: {_same_audio(s)}")
    fid = s.get("fidelity")
    if m.get(FIDELITY_FAILED):
        why = s.get("fidelity_error") or "its error is in the run's result record"
        out.append(f"{name}: fidelity failed ({why}): exactness unmeasured")
    elif not fid and s.get("status") in ("ok", "partial") and _techniques(s):
        out.append(f"{name}: no fidelity recorded: exactness unmeasured")
    elif fid and fid.get("not_covered"):
        slots = ", ".join(f"{slot} ({t})" for slot, t in fid["not_covered"].items())
        out.append(f"{name}: fidelity never ran its {slots}: not measured there")
    return out


def _techniques(s: Mapping[str, Any]) -> int:
    return len((s.get("spec") or {}).get("techniques", [None]))


def _same_audio(s: Mapping[str, Any]) -> str:
    """The pair whose waveforms are the same, from the record or the stored rounds."""
    if same := s.get("audio_independent_of_input"):
        return (
            f"{same['a']} and {same['b']} (different {same['differs_in']}) give the same waveform"
        )
    m = s.get("metrics") or {}
    rounds = [int(m.get(k, -1)) for k in SAME_AUDIO_ROUNDS]
    by_round = {u["round"]: u for u in s.get("utterances") or []}
    said = [
        f"{u['prompt_id']}/seed {u['seed']}" if (u := by_round.get(r)) else f"round {r}"
        for r in rounds
    ]
    return f"{said[0]} and {said[1]} give the same waveform"


def environment_line(env: Mapping[str, Any] | None) -> str:
    """What the numbers were measured on, host CPU included (a stock figure is the host's
    as much as the device's): device, CPU model, cores, max clock, single-thread speed."""
    env = env or {}
    parts = [env.get("device_name") or "?", "host " + host_line(env)]
    parts += [f"torch {env['torch']}"] if env.get("torch") else []
    return "environment: " + " · ".join(parts)


def host_line(env: Mapping[str, Any]) -> str:
    """The host CPU: model, cores, max clock, single-thread speed."""
    cpu = [env.get("cpu_model") or "CPU ?", f"{env.get('cpu_count', '?')} logical cores"]
    if env.get("cpu_max_mhz"):
        cpu.append(f"max {env['cpu_max_mhz'] / 1e3:.2f} GHz")
    if env.get("cpu_single_thread_ms"):
        cpu.append(f"single-thread loop {env['cpu_single_thread_ms']:.1f} ms")
    return ", ".join(cpu)


def stack_table(title: str | None, stacks: list[dict[str, Any]], confidence: float = 0.95) -> Table:
    """stacks: [{name, status, exact, spec, fidelity, metrics: {...}, skipped: {...}}],
    baseline first, as a terminal table (`stack_cells` says what each column holds)."""
    headers, rows = stack_cells(stacks, confidence)
    table = ReadableTable(title=title)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < 2 or i == len(headers) - 1 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def stack_cells(
    stacks: list[dict[str, Any]], confidence: float = 0.95
) -> tuple[list[str], list[list[str]]]:
    """The stacks table's headers and cells, for the terminal and the report page alike (one
    definition of every printed figure). The speedup column is the stored headline (paired,
    with its CI); the aggregate RTF ratio stands beside it, labelled as such. A serving run's
    stacks get the serving columns instead.

    Columns a run has only sometimes (OmniVoice's S, speedups against a second baseline
    declared `baseline: true`) appear when some stack has them."""
    present = {k for s in stacks for k in s.get("metrics", {})}
    if "serve.streams" in present:
        return _serving_cells(stacks)
    refs = sorted(
        k.removeprefix(f"{HEADLINE}_vs_") for k in present if k.startswith(f"{HEADLINE}_vs_")
    )
    # A column no stack has (per-token floors on OmniVoice, say) is left out, not dashed.
    always = {"median_latency_s", "rtf", HEADLINE, AGGREGATE}
    columns = [c for c in COLUMNS if c[0] in present or c[0] in always]
    columns += [("S", "S", "{:.4f}")] * ("S" in present)
    if "ms_per_forward" in present:  # whole-sequence forwards (OmniVoice's steps)
        columns += [
            ("ms_per_forward", "ms/fwd", "{:.2f}"),
            ("forward_fraction_of_floor", "fwd of floor", "{:.0%}"),
        ]
    columns += [(f"{HEADLINE}_vs_{r}", f"vs {r} (paired)", "") for r in refs]
    headers = ["stack", "status"]
    headers += [headline_label(confidence) if k == HEADLINE else h for k, h, _ in columns]
    headers += ["valid", "exact"]
    rows = []
    for i, s in enumerate(stacks):
        m = s.get("metrics", {})
        cells = []
        for key, _, fmt in columns:
            if key in (HEADLINE, AGGREGATE) and i == 0:
                cells.append("baseline")
            elif key == HEADLINE and invalid_reasons(m, s.get("invalid_reason")):
                cells.append("INVALID")  # a time faster than its floor is no speedup
            elif key.startswith(HEADLINE):
                cells.append(headline_cell(m, key.removeprefix(HEADLINE)))
            else:
                cells.append(fmt.format(m[key]) if key in m else "-")
        valid = f"{int(m.get('valid_recordings', 0))}/{int(m.get('utterances', 0))}" if m else "-"
        # The names and reasons go under the table (skipped_lines): a cell would wrap.
        status = s["status"] + (f" ({len(s['skipped'])} skipped)" if s.get("skipped") else "")
        status += " · noisy" if noise_reasons(s["name"], m) else ""
        status += " · INVALID" if invalid_reasons(m, s.get("invalid_reason")) else ""
        status += " · same audio" if m.get(SAME_AUDIO) else ""
        rows.append([s["name"], status, *cells, valid, exact_cell(s)])
    return headers, rows


def table_note(stacks: list[dict[str, Any]]) -> str:
    """The line under a stacks table saying what its figures are (stack_cells' columns)."""
    if any("serve.streams" in s.get("metrics", {}) for s in stacks):
        # here, not at the top: running.serving brings numpy (about 0.14 s on every command)
        from orchestrate.running.serving import DEFINITIONS

        return (
            f"A serving run: per stack, its streams. Served: {DEFINITIONS['served']}, where "
            f"{DEFINITIONS['underruns']}. First audio: {DEFINITIONS['ttfa_s']}. Stream RTF: "
            f"{DEFINITIONS['rtf']}. Audio s/s: {DEFINITIONS['audio_s_per_s']}."
        )
    return (
        "The speedup is the paired headline (per utterance, baseline and stack timed in the "
        "same round) with its confidence interval; the aggregate RTF ratio beside it is total "
        "time over total audio."
    )


PHASE_KEY, MEMORY_KEY = "serve.phase_ms_per_step.", "serve.memory_bytes."
# The order a step runs its phases in (running/serving.py's phase names); others follow.
PHASE_ORDER = ("prefill", "step", "codec", "codec_launch", "codec_wait", "host", "other")
MEMORY_ORDER = ("weights_read", "weights_copied", "weights_unread", "cache")


def _ordered(keys: list[str], prefix: str, order: tuple[str, ...]) -> list[str]:
    names = [k.removeprefix(prefix) for k in dict.fromkeys(keys) if k.startswith(prefix)]
    rank = {name: i for i, name in enumerate(order)}
    return [prefix + n for n in sorted(names, key=lambda n: (rank.get(n, len(order)), n))]


def serving_detail(stacks: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], str] | None:
    """Per serving stack, where a decode step goes (ms per step in each phase its server
    timed) and the memory the server holds (GB = 1e9 bytes): headers, rows and the line
    defining them; None where no stack has either."""
    from orchestrate.running.serving import DEFINITIONS

    keys = [k for s in stacks for k in s.get("metrics", {})]
    phases = _ordered(keys, PHASE_KEY, PHASE_ORDER)
    memory = _ordered(keys, MEMORY_KEY, MEMORY_ORDER)
    if not phases and not memory:
        return None
    headers = ["stack"] + [f"{k.removeprefix(PHASE_KEY)} ms/step" for k in phases]
    headers += [f"{k.removeprefix(MEMORY_KEY)} GB" for k in memory]
    rows = []
    for s in stacks:
        m = s.get("metrics", {})
        cells = [f"{m[k]:.3f}" if k in m else "-" for k in phases]
        cells += [f"{m[k] / 1e9:.3g}" if k in m else "-" for k in memory]
        rows.append([s["name"], *cells])
    note = (
        f"ms/step: {DEFINITIONS['phase_ms_per_step']}. GB: {DEFINITIONS['memory_bytes']}; "
        "1 GB = 1e9 bytes."
    )
    return headers, rows, note


def _serving_cells(stacks: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["stack", "status", *(h for _, h, _ in SERVING_COLUMNS), "exact"]
    rows = []
    for s in stacks:
        m = s.get("metrics", {})
        cells = [fmt.format(m[key]) if key in m else "-" for key, _, fmt in SERVING_COLUMNS]
        rows.append([s["name"], s["status"], *cells, exact_cell(s)])
    return headers, rows


def fidelity_scope(family: str | None) -> str:
    """One line saying what a run's fidelity figures cover (and so what `exact` rests on)."""
    from orchestrate.api.registry import get_family

    try:
        fam: Any = get_family(family or "")
    except Exception:  # not installed here: say what the core knows
        fam = None
    covers = getattr(fam, "fidelity_covers", None)
    if covers:
        return f"fidelity covers: {covers}"
    slots = [s for s in getattr(fam, "slots", ()) if s not in UNCOVERED_SLOTS]
    missing = [s for s in getattr(fam, "slots", UNCOVERED_SLOTS) if s in UNCOVERED_SLOTS]
    return (
        "fidelity covers: teacher-forced next-step logits vs stock"
        + (f" ({', '.join(slots)} slots)" if slots else "")
        + (
            f"; the {' and '.join(missing)} slots only where a technique fills them "
            "(sampler: draws vs stock's sampler; loop: tokens vs stock's loop), per stack below"
            if missing
            else ""
        )
    )


def fidelity_verdict(fid: Mapping[str, Any]) -> str:
    """'within tolerance', or 'OUTSIDE tolerance' naming the parts that put it there: the
    verdict covers the logits and the sampler and loop tests, and the line's figures are the
    logits' alone, so a reader must not have to guess which part failed."""
    if fid["within_tolerance"]:
        return "within tolerance"
    failed = []
    sampler_failed = fid.get("sampler_tv") is not None and (
        fid["sampler_tv"] > fid["sampler_tv_bound"]
    )
    loop_failed = fid.get("loop_tokens_identical") is False
    logits_ok = fid.get("logits_within_tolerance")
    if logits_ok is False or (logits_ok is None and not (sampler_failed or loop_failed)):
        failed.append("logits")
    if sampler_failed:
        failed.append("sampler")
    if loop_failed:
        failed.append("loop tokens")
    return f"OUTSIDE tolerance ({', '.join(failed)})"


def slot_checks_line(name: str, fid: Mapping[str, Any]) -> str | None:
    """One line for the sampler and loop tests a stack's fidelity ran, or None."""
    parts = []
    if fid.get("sampler_tv") is not None:
        ok = fid["sampler_tv"] <= fid["sampler_tv_bound"]
        parts.append(
            f"sampler TV {fid['sampler_tv']:.3f} vs bound {fid['sampler_tv_bound']:.3f} "
            f"({fid.get('sampler_draws')} draws per row): {'same' if ok else 'NOT the same'} "
            "distribution as stock's sampler"
        )
    if fid.get("loop_tokens_identical") is not None:
        parts.append(f"loop: {fid.get('loop_note')}")
    return f"{name}: " + "; ".join(parts) if parts else None


def skipped_lines(stacks: list[dict[str, Any]]) -> list[str]:
    """Under a run's table, one line per partial stack: what it skipped and why (the reason
    tells a user whether to care), techniques skipped for the same reason together."""
    lines = []
    for s in stacks:
        by_reason: dict[str, list[str]] = {}
        for technique, why in (s.get("skipped") or {}).items():
            by_reason.setdefault(why, []).append(technique)
        if by_reason:
            parts = [f"{', '.join(names)} ({why})" for why, names in by_reason.items()]
            lines.append(f"{s['name']}: skipped {'; '.join(parts)}")
    return lines


def error_line(error: str | None, width: int | None = None) -> str:
    """A run's error as one line, cut at the end to `width` characters: after a traceback,
    its last line (the exception); otherwise the first line (what happened: an exit status,
    a signal) and, when there is more, the last non-empty one."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    if not lines:
        return ""
    head = lines[0].removesuffix("; last output:")
    if len(lines) == 1 or any(line.startswith("Traceback (most recent call") for line in lines):
        text = lines[-1]
    else:
        text = f"{head}: {lines[-1]}"
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


def _cell(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def run_diff_tables(d: RunDiff) -> list[Table | str]:
    """`orchestrate diff`: one table per part that has a difference, then a summary line."""
    a, b = d.a[:8], d.b[:8]
    out: list[Table | str] = []
    if d.settings:
        table = ReadableTable(title=f"settings and environment · {a} -> {b}")
        for col in ("key", a, b):
            table.add_column(col)
        for c in d.settings:
            table.add_row(c.key, _cell(c.a), _cell(c.b))
        out.append(table)
    if d.stacks or d.only_in_a or d.only_in_b:
        table = ReadableTable(title="stacks")
        for col in ("stack", "key", a, b):
            table.add_column(col)
        for name in d.only_in_a:
            table.add_row(name, "", "present", "(absent)")
        for name in d.only_in_b:
            table.add_row(name, "", "(absent)", "present")
        for name, changes in d.stacks.items():
            for c in changes:
                table.add_row(name, c.key, _cell(c.a), _cell(c.b))
        out.append(table)
    if d.metrics:
        table = ReadableTable(title=f"metrics that moved more than {d.threshold:.1%}")
        for col in ("stack", "metric", a, b, "b / a"):
            table.add_column(col, justify="left" if col in ("stack", "metric") else "right")
        for m in d.metrics:
            ratio = "" if m.ratio is None else f"{m.ratio:.4g}x"
            table.add_row(m.stack, m.metric, f"{m.a:.6g}", f"{m.b:.6g}", ratio)
        out.append(table)
    out.append(
        f"{len(d.settings)} settings, {len(d.stacks) + len(d.only_in_a) + len(d.only_in_b)} "
        f"stacks and {len(d.metrics)} metrics differ; {d.unchanged_metrics} shared metrics "
        f"are within {d.threshold:.1%}"
    )
    return out
