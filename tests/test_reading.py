"""What a researcher reads (issue 35): tables that wrap instead of cutting, help that reads
piped at 80 columns, no Python reprs, `--version`, progress lines when piped, outputs that
stay out of the package, and figures that do not mislead. One test per observation; all
in-process on fabricated records."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_reports
from factories import fabricate_result, run_cli
from rich.console import Console

from orchestrate.api import protocol as proto
from orchestrate.reports.tables import stack_table
from orchestrate.store.store import Store

PROTOCOL = test_reports.PROTOCOL
history = test_reports.history  # the fixture: a stored research history (tests/test_reports.py)


def rendered(renderable: Any, width: int) -> str:
    """What a terminal `width` columns wide shows of `renderable`."""
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def _stack(name: str, speedup: float, lo: float, hi: float) -> dict[str, Any]:
    metrics = {
        "median_latency_s": 2.133, "p95_latency_s": 2.339, "rtf": 0.3226,
        "audio_s_per_compute_s": 3.10, "tokens_per_s": 332.5, "ms_per_token": 3.01,
        "gpu_busy_ms_per_step": 1.2, "achieved_gb_s": 1.0, "fraction_of_floor": 0.07,
        "gpu_needed_gb": 7.5, "speedup_paired": speedup, "speedup_paired_lo": lo,
        "speedup_paired_hi": hi, "speedup_vs_baseline": speedup, "valid_recordings": 8,
        "utterances": 8, "speedup_paired_n": 8,
    }  # fmt: skip
    return {"name": name, "status": "ok", "metrics": metrics, "spec": {"techniques": []}}


def test_main_table_at_120_columns_wraps_cells_instead_of_cutting_them() -> None:
    stacks = [_stack("stock", 1.0, 1.0, 1.0), _stack("exp74-full-int8", 1.51, 1.45, 1.58)]
    for s in stacks:  # a CPU run's columns (README "What you see")
        del s["metrics"]["gpu_busy_ms_per_step"], s["metrics"]["gpu_needed_gb"]
    text = rendered(stack_table("run abd59f03 · FINISHED · smoke · cpu", stacks), 120)
    assert "…" not in text and "..." not in text, text
    words = set(text.split())
    for word in ("speedup", "(paired,", "CI)", "exp74-full-int8", "1.51x", "[1.45,", "baseline"):
        assert word in words, f"{word!r} cut:\n{text}"


def test_a_wider_gpu_table_folds_but_loses_no_column() -> None:
    stacks = [_stack("stock", 1.0, 1.0, 1.0), _stack("exp74-full-int8", 1.51, 1.45, 1.58)]
    text = rendered(stack_table("run", stacks), 120)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 120
    for word in ("valid", "exact", "8/8", "yes", "needed", "1.58]"):
        assert word in text.split(), f"{word!r} lost:\n{text}"


# ------------------------------------------------------------------ commands, in-process

LONG_WHY = (
    "retained by the gate: the remeasure's paired speedup 1.02x [0.97, 1.08] does not clear "
    "the protocol's min_speedup 1.05x, so speed is not established beyond the A/A noise"
)


def invoke(args: list[str]) -> Any:
    """`orchestrate ARGS` in this process (typer's runner), stdout and stderr apart."""
    from typer.testing import CliRunner

    from orchestrate.cli import app

    return CliRunner().invoke(app, args, catch_exceptions=False)


def db_of(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'runs.db'}"  # the `history` fixture's database


def readable(text: str) -> str:
    """A table's text with its rules and wrapping undone: one space between words."""
    return " ".join(w for w in text.split() if set(w) - set("─━│┃┏┓┗┛┡┩└┘╇┳┻╋┼"))


def test_ledger_shows_the_whole_reason(history: Store, tmp_path: Path) -> None:
    history.record_failure("B", "slower", LONG_WHY)
    out = invoke(["ledger", "--db", db_of(tmp_path), "--out", str(tmp_path / "l.md")])
    assert out.exit_code == 0, out.output
    assert LONG_WHY in readable(out.stdout), out.stdout


def test_frontier_shows_the_whole_why_and_no_python_repr(history: Store, tmp_path: Path) -> None:
    proto.write(PROTOCOL, tmp_path / "protocol.yaml")  # the history's protocol
    args = [
        "--db",
        db_of(tmp_path),
        "--workload",
        "smoke",
        "--protocol",
        str(tmp_path / "protocol.yaml"),
    ]
    out = invoke(["frontier", *args])
    assert out.exit_code == 0, out.output
    text = readable(out.stdout)
    assert "exact stack outside fidelity tolerance (exactness failed)" in text, out.stdout
    assert "{" not in out.stdout and "': " not in out.stdout, out.stdout  # no dict repr
    assert "not shown: 1 run: protocol" in text, out.stdout


def test_schema_help_names_the_schemas_without_a_python_list() -> None:
    out = invoke(["schema", "--help"])
    assert "['" not in out.stdout and "model, protocol, stack, workload" in readable(out.stdout)


def test_schema_of_one_model_is_the_bare_json_schema() -> None:
    one = json.loads(invoke(["schema", "stack"]).stdout)
    assert one["title"] == "StackSpec" and "properties" in one  # usable as `$schema`
    every = json.loads(invoke(["schema"]).stdout)
    assert set(every) == {"model", "protocol", "stack", "workload"} and every["stack"] == one


def test_version_names_the_package_and_the_commit() -> None:
    from importlib.metadata import version

    out = invoke(["--version"])
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith(f"orchestrate {version('orchestrate')}"), out.stdout
    sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    if sha.returncode == 0:  # a checkout: the commit is named
        assert sha.stdout.strip() in out.stdout, out.stdout


def test_piped_help_at_80_columns_keeps_option_names_and_defaults_whole(tmp_path: Path) -> None:
    env = os.environ | {"COLUMNS": "80"}
    out = run_cli(["gate", "--help"], env, tmp_path)  # stdout is a pipe here
    assert out.returncode == 0, out.stderr
    assert max(len(line) for line in out.stdout.splitlines()) <= 80, out.stdout
    text = " ".join(out.stdout.split())  # wrapped between words is fine; cut is not
    for whole in ("--allow-holdout-reuse", "--no-allow-holdout-reuse", "[default: protocol]",
                  "[default: no-allow-holdout-reuse]", "configs/protocol.yaml"):  # fmt: skip
        assert whole in text, f"{whole!r} cut:\n{out.stdout}"


def test_run_progress_piped_prints_a_line_per_phase_and_per_stack(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from orchestrate.cli.app import _progress

    events = [
        {"event": "status", "message": "building tiny on cpu"},
        {"event": "status", "message": "warming up cpu-fast (3x)"},
        *[
            {"event": "progress", "done": i + 1, "total": 4, "stack": name, "latency_s": lat}
            for i, (name, lat) in enumerate(
                [("stock", 2.0), ("cpu-fast", 1.0), ("stock", 3.0), ("cpu-fast", 1.5)]
            )
        ],
    ]
    with _progress(quiet=False) as on_event:  # stdout is not a terminal under pytest
        for event in events:
            on_event(event)
    out = capsys.readouterr()
    assert out.err == ""  # stderr is kept for a failure's one line
    lines = out.out.splitlines()
    assert lines == [
        "building tiny on cpu",
        "warming up cpu-fast (3x)",
        "timing 4 utterances, stacks interleaved",
        "timed stock: 2 utterances, median 2.50 s",
        "timed cpu-fast: 2 utterances, median 1.25 s",
    ], lines


def test_score_says_each_phase_and_each_stack_scored(tmp_path: Path) -> None:
    from orchestrate.api.protocol import Protocol
    from orchestrate.api.scoring import create_scorers
    from orchestrate.research.scoring_run import score_result

    result = fabricate_result(audio_dir=tmp_path)
    events: list[dict[str, Any]] = []
    scorers = [s.load() for s in create_scorers(["integrity"])]  # cheap: no weights
    score_result(result, Protocol(), tmp_path, scorers, on_event=events.append)
    said = [e["message"] for e in events if e["event"] == "status"]
    stacks = [r.stack.name for r in result.results]
    assert [m.split(":")[0] for m in said] == [f"scored {name}" for name in stacks], said
    n = len(result.results[0].utterances)
    assert said[0] == f"scored {stacks[0]}: {n} utterances, {n} new scores", said


def test_explore_why_is_not_cut(capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrate.cli.explore import show_exploration

    candidate = {
        "seq": 1, "proposer": "ladder", "change": "+ cuda_graph", "stack_name": "s1",
        "vs_parent": 1.02, "vs_parent_lo": 0.97, "vs_parent_hi": 1.08, "headline": 1.02,
        "headline_lo": 0.97, "headline_hi": 1.08, "decision": "retain", "phase": "done",
        "reason": LONG_WHY + "; " + LONG_WHY, "parent_name": "stock", "judged": True,
    }  # fmt: skip
    row = {
        "id": "e" * 32, "status": "finished", "workload_name": "smoke", "hardware": "cpu",
        "jobs": 3, "elapsed_s": 120.0, "candidates": [candidate], "champion": {"name": "stock"},
        "champion_headline": 1.0, "champion_lo": None, "champion_hi": None, "stop_reason": None,
    }  # fmt: skip
    show_exploration(row)
    assert candidate["reason"] in readable(capsys.readouterr().out)


# ------------------------------------------------------------------------------ defaults


def test_ledger_and_figures_default_beside_the_store_not_into_the_package(
    history: Store, tmp_path: Path
) -> None:
    from orchestrate.api.config import REPO_ROOT

    before = (REPO_ROOT / "reports" / "ledger.md").stat().st_mtime_ns if (
        REPO_ROOT / "reports" / "ledger.md").exists() else None  # fmt: skip
    out = invoke(["ledger", "--db", db_of(tmp_path)])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "runs-reports" / "ledger.md").is_file(), out.stdout
    after = (REPO_ROOT / "reports" / "ledger.md").stat().st_mtime_ns if (
        REPO_ROOT / "reports" / "ledger.md").exists() else None  # fmt: skip
    assert after == before  # the package's folder untouched


def test_frontier_defaults_to_the_workload_the_database_last_ran(
    history: Store, tmp_path: Path
) -> None:
    test_reports.record(
        history, 9, [test_reports.stack_result(test_reports.spec("L"), 1.3)], "long"
    )
    proto.write(PROTOCOL, tmp_path / "protocol.yaml")
    out = invoke(
        ["frontier", "--db", db_of(tmp_path), "--protocol", str(tmp_path / "protocol.yaml")]
    )
    assert out.exit_code == 0, out.output
    assert "experiments · long" in out.stdout, out.stdout


def table_rows(text: str) -> dict[str, list[str]]:
    """A rich table's body as {first cell: its cells}, each cell's wrapped lines joined."""
    rows: dict[str, list[list[str]]] = {}
    current: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0]:  # a row starts; a blank first cell continues the one above
            current = rows[cells[0]] = [[c] for c in cells]
        else:
            for part, cell in zip(current, cells, strict=True):
                part.append(cell)
    return {
        name: [" ".join(w for w in part if w) for part in parts] for name, parts in rows.items()
    }


def test_stacks_show_family_and_validity_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrate.api.config import EXPERIMENTS_DIR

    user = tmp_path / "experiments"  # a user's ./experiments, listed beside the shipped ones
    user.mkdir()
    (user / "my-broken.yaml").write_text(
        "name: my-broken\nfamily: omnivoice\ntechniques:\n  - name: no_such_technique\n"
    )
    (user / "my-unparsable.yaml").write_text("name: [unclosed\n")
    monkeypatch.chdir(tmp_path)
    known = {
        name: family
        for name, family in (("exp74-full", "rumik"), ("ov-recipe", "omnivoice"))
        if (EXPERIMENTS_DIR / f"{name}.yaml").is_file()
    }

    out = invoke(["stacks", "--json"])
    assert out.exit_code == 0, out.output
    by_name = {r["name"]: r for r in json.loads(out.stdout)}
    for name, family in known.items():
        assert by_name[name]["family"] == family and by_name[name]["valid"] is True
    broken = by_name["my-broken"]
    assert broken["valid"] is False and broken["family"] == "omnivoice"
    assert "unknown technique 'no_such_technique'" in broken["error"], broken
    unparsable = by_name["my-unparsable"]
    assert unparsable["valid"] is False and "not valid YAML" in unparsable["error"], unparsable

    out = invoke(["stacks"])
    assert out.exit_code == 0, out.output
    header = next(line for line in out.stdout.splitlines() if line.startswith("┃"))
    columns = [c.strip() for c in header.strip().strip("┃").split("┃")]
    rows = {name: dict(zip(columns, cells, strict=True)) for name, cells in
            table_rows(out.stdout).items()}  # fmt: skip
    for name, family in known.items():
        assert rows[name]["family"] == family and rows[name]["valid"] == "yes", rows[name]
    assert rows["my-broken"]["family"] == "omnivoice", rows["my-broken"]
    assert rows["my-broken"]["valid"] == f"no: {broken['error']}"  # the reason whole, not cut
