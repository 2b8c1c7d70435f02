"""`exact` is measured, not taken on a plugin's word: a third-party technique declared exact
that moves one logit is shown as failing exactness (`NO (measured)`, `exactness: failed`),
its status unchanged, and `run --strict` exits 3; an honest exact stack in the same run
stays `yes`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrate.reports.tables import annotate, stack_table
from orchestrate.running.metrics import exactness

# A head that returns the wrapped head's logits with one audio-unit column raised: what a
# "harmless" exact optimisation with an off-by-one looks like from outside.
PLUGIN = """
import dataclasses

from orchestrate.api.technique import Technique


class _OneLogitMoved:
    def __init__(self, inner):
        self.inner = inner
        self.bytes_per_step = getattr(inner, "bytes_per_step", None)

    def __call__(self, hidden, step):
        out = self.inner(hidden, step)
        cols = out.unit_columns
        col = cols.start if isinstance(cols, slice) else int(cols[0])
        logits = out.logits.clone()
        logits[:, col] += 50.0
        return dataclasses.replace(out, logits=logits)


class OneLogit(Technique):
    name = "one_logit"
    version = 1
    family = "rumik"
    exact = True  # the claim under test
    slots = ("head",)
    summary = "test plugin: declared exact, moves one logit"

    def apply(self, engine):
        engine.head = _OneLogitMoved(engine.head)
"""
WORKLOAD = """\
name: exactness
prompts:
  - {id: a, text: "A short first sentence."}
  - {id: b, text: "And a second one."}
seeds: [42]
warmups: 0
length_policy: {mode: fixed, frames: 4}
save_audio: 0
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """The plugin laid out as pip would install it (code + dist-info) on a folder that only
    the CLI subprocess (and its worker) has on its path."""
    site = tmp_path / "site"
    (site / "one_logit_plugin").mkdir(parents=True)
    (site / "one_logit_plugin" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "one_logit_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: one-logit-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[orchestrate.techniques]\none_logit = one_logit_plugin:OneLogit\n"
    )
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    (tmp_path / "liar.yaml").write_text("name: liar\ntechniques: [{name: one_logit}]\n")
    (tmp_path / "honest.yaml").write_text("name: honest\ntechniques: [{name: audio_head}]\n")
    return site


def cli(args: list[str], tmp: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp / 'runs.db'}",
        "PYTHONUNBUFFERED": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_declared_exact_but_measured_otherwise_fails_exactness(tmp_path: Path, site: Path) -> None:
    args = ["run", "--stack", "liar.yaml", "--stack", "honest.yaml", "--workload", "wl.yaml",
            "--no-mlflow", "--fidelity-steps", "8"]  # fmt: skip
    plain = cli([*args, "--json"], tmp_path, site)
    assert plain.returncode == 0, plain.stderr  # without --strict: reported, not fatal
    run = json.loads(plain.stdout)
    by = {s["name"]: s for s in run["stacks"]}
    liar, honest = by["liar"], by["honest"]
    assert liar["exact"] and not liar["fidelity"]["within_tolerance"]  # claim vs measurement
    assert liar["status"] == "ok" and liar["exactness"] == "failed"
    assert liar["metrics"]["exactness_failed"] == 1.0  # stored: MLflow and SQL see it too
    assert honest["exactness"] == "exact" and honest["metrics"]["exactness_failed"] == 0.0

    shown = cli(["show", run["id"][:8]], tmp_path, site).stdout
    liar_row = next(line for line in shown.splitlines() if line.strip().startswith("liar "))
    honest_row = next(line for line in shown.splitlines() if line.strip().startswith("honest "))
    assert "NO (measured)" in liar_row and "yes" in honest_row
    assert "exactness failed" in shown
    # what the fidelity figures cover, and what they cannot vouch for
    assert "teacher-forced next-step logits" in shown
    assert "sampler and loop slots only where a technique fills them" in shown

    strict = cli([*args, "--strict", "--json"], tmp_path, site)
    assert strict.returncode == 3, strict.stderr
    assert "liar" in strict.stderr and "honest" not in strict.stderr
    strict_run = json.loads(strict.stdout)
    assert strict_run["stacks"][1]["exactness"] == "failed"
    again = cli([*args, "--strict"], tmp_path, site)  # the recorded run answers the same
    assert again.returncode == 3, again.stderr
    if not strict_run["noisy"]:  # a noisy run is never served back: it is measured again
        assert "already recorded" in again.stdout


def test_exactness_verdicts() -> None:
    assert exactness(True, True) == "exact"
    assert exactness(True, False) == "failed"
    assert exactness(True, None) == "unmeasured"
    assert exactness(False, False) == "approximate"
    assert exactness(True, False, techniques=0) == "exact"  # stock is the reference


def test_table_and_json_carry_the_measured_verdict() -> None:
    fid = {"within_tolerance": False, "steps": 8}
    row = {
        "stacks": [
            {"name": "stock", "status": "ok", "exact": True, "spec": {"techniques": []},
             "fidelity": None, "metrics": {}},
            {"name": "liar", "status": "ok", "exact": True,
             "spec": {"techniques": [{"name": "one_logit"}]}, "fidelity": fid, "metrics": {}},
        ]
    }  # fmt: skip
    annotate(row)
    assert [s["exactness"] for s in row["stacks"]] == ["exact", "failed"]
    table = stack_table(None, row["stacks"])
    assert list(table.columns[-1].cells) == ["yes", "NO (measured)"]
    assert row["stacks"][1]["status"] == "ok"  # status stays what it was
