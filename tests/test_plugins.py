"""Plugin discovery as a third party meets it: a broken technique package, a technique that
claims a slot its family does not declare, and a whole external model family.

Each "installed" package is a real distribution to importlib.metadata: a module plus a
`*.dist-info` folder with its entry points, on the path of a subprocess, so nothing is
installed into the project's environment and the CLI is exercised as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

WORKLOAD = """\
name: plug
prompts:
  - {id: a, text: "A short first sentence."}
  - {id: b, text: "And a second one."}
seeds: [42]
warmups: 1
length_policy: {mode: fixed, frames: 4}
save_audio: 0
"""


def install(site: Path, dist: str, modules: dict[str, str], entry_points: str) -> None:
    """Lay out a distribution on `site` as pip would leave it (code + dist-info)."""
    for name, code in modules.items():
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(code))
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


def cli(args: list[str], tmp: Path, site: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp / 'runs.db'}",
        "PYTHONUNBUFFERED": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
    )


BROKEN = {
    "broken_plugin/__init__.py": "",
    "broken_plugin/crashes.py": """\
        raise ImportError("this plugin's optional dependency is missing")
    """,
    "broken_plugin/badslot.py": """\
        from orchestrate.api.technique import Technique

        class BadSlot(Technique):
            name = "bad_slot"
            family = "rumik"
            exact = True
            slots = ("vocoder",)  # Rumik declares no such slot

            def apply(self, engine):
                engine.vocoder = None
    """,
}
BROKEN_EPS = """\
    [orchestrate.techniques]
    crashes = broken_plugin.crashes:Crashes
    bad_slot = broken_plugin.badslot:BadSlot
"""


@pytest.mark.slow
def test_a_broken_plugin_is_listed_and_the_rest_still_run(tmp_path):
    site = tmp_path / "site"
    install(site, "broken_plugin", BROKEN, BROKEN_EPS)
    (tmp_path / "wl.yaml").write_text(WORKLOAD)

    listed = cli(["techniques", "--json"], tmp_path, site)
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["crashes"]["broken"]
    assert "optional dependency is missing" in rows["crashes"]["error"]
    assert rows["bad_slot"]["broken"]
    assert "'vocoder'" in rows["bad_slot"]["error"] and "'rumik'" in rows["bad_slot"]["error"]
    for builtin in ("static_kv_cache", "packed_projections", "audio_head", "graph_loop"):
        assert not rows[builtin].get("broken"), builtin  # the built-ins are all still there

    table = cli(["techniques"], tmp_path, site)
    assert table.returncode == 0 and "BROKEN" in table.stdout

    # A stack naming the broken slot technique fails with the slot and the family named...
    (tmp_path / "bad.yaml").write_text("name: bad\nfamily: rumik\ntechniques: [{name: bad_slot}]\n")
    bad = cli(
        ["run", "--stack", str(tmp_path / "bad.yaml"), "--workload", "wl.yaml", "--no-mlflow"],
        tmp_path,
        site,
    )
    assert bad.returncode == 2
    assert "bad_slot" in bad.stderr and "vocoder" in bad.stderr and "rumik" in bad.stderr

    # ...while a stack of built-ins still runs end to end beside the broken package.
    ok = cli(
        [
            "run",
            "--stack",
            "cpu-fast",
            "--workload",
            "wl.yaml",
            "--no-mlflow",
            "--fidelity-steps",
            "4",
            "--json",
        ],
        tmp_path,
        site,
    )
    assert ok.returncode == 0, ok.stderr
    run = json.loads(ok.stdout)
    assert run["status"] == "FINISHED"
    assert {s["name"]: s["status"] for s in run["stacks"]} == {"stock": "ok", "cpu-fast": "ok"}


TOY = {
    "toy_tts/__init__.py": "",
    "toy_tts/family.py": """\
        \"\"\"A minimal external family: a 'model' that hums one sine tone per character.\"\"\"
        import time
        from dataclasses import dataclass, field

        import numpy as np

        from orchestrate.api.family import Family, Synthesis

        RATE = 8_000


        def stock_tone(n: int) -> np.ndarray:
            return np.sin(np.arange(n) * 0.05).astype(np.float32) * 0.1


        @dataclass
        class Engine:
            tone: object = stock_tone
            filled: dict = field(default_factory=dict)


        class ToyFamily(Family):
            name = "toy"
            slots = ("tone",)
            presets = ("toy-small",)
            baseline = "toy-stock"
            workload = "plug"

            def build_model(self, spec):
                return {"preset": spec.preset}

            def config_hash(self, model):
                return "0" * 16

            def build_engine(self, model, stack):
                engine = Engine()
                for technique in stack.techniques:
                    technique.apply(engine)
                    for slot in (*technique.slots, *technique.wraps):
                        engine.filled[slot] = technique.name
                return engine

            def synthesize(self, engine, text, seed, workload):
                t0 = time.perf_counter()
                audio = engine.tone(RATE // 10 * max(1, len(text) // 8))
                took = time.perf_counter() - t0
                return Synthesis(
                    latency_s=took, lm_s=took, codec_s=0.0, prefill_s=None,
                    prompt_tokens=len(text), new_tokens=len(text), frames=len(text),
                    stop_reason="length_policy", audio=audio, sample_rate=RATE,
                )

            def step_bytes(self, engine, context):
                return None

            def fidelity(self, model, engines, workload, steps):
                return {}
    """,
    "toy_tts/cached_tone.py": """\
        import functools

        import numpy as np

        from orchestrate.api.technique import Technique


        class CachedTone(Technique):
            name = "cached_tone"
            family = "toy"
            exact = True
            slots = ("tone",)
            summary = "the tone computed once per length"

            def apply(self, engine):
                stock = engine.tone
                engine.tone = functools.lru_cache(maxsize=None)(lambda n: np.array(stock(n)))
    """,
}
TOY_EPS = """\
    [orchestrate.families]
    toy = toy_tts.family:ToyFamily

    [orchestrate.techniques]
    cached_tone = toy_tts.cached_tone:CachedTone
"""


@pytest.mark.slow
def test_an_external_family_package_runs_end_to_end(tmp_path):
    site = tmp_path / "site"
    install(site, "toy_tts", TOY, TOY_EPS)
    (tmp_path / "plug.yaml").write_text(WORKLOAD)
    (tmp_path / "toy-small.yaml").write_text("family: toy\npreset: toy-small\ndevice: cpu\n")
    (tmp_path / "toy-stock.yaml").write_text("name: toy-stock\nfamily: toy\ntechniques: []\n")
    (tmp_path / "toy-fast.yaml").write_text(
        "name: toy-fast\nfamily: toy\ntechniques: [{name: cached_tone}]\n"
    )

    fams = cli(["families", "--json"], tmp_path, site)
    assert fams.returncode == 0, fams.stderr
    toy = next(f for f in json.loads(fams.stdout) if f["name"] == "toy")
    assert toy["slots"] == ["tone"] and toy["baseline"] == "toy-stock"

    explained = cli(
        [
            "explain",
            str(tmp_path / "toy-fast.yaml"),
            "--model",
            str(tmp_path / "toy-small.yaml"),
            "--json",
        ],
        tmp_path,
        site,
    )
    assert explained.returncode == 0, explained.stderr
    (line,) = json.loads(explained.stdout)["slots"]
    assert line["slot"] == "tone" and line["filled_by"] == "cached_tone"
    assert line["stock"].endswith(":stock_tone") and "CachedTone.apply" in line["occupant"]

    # The family's own baseline and workload are the defaults: the CLI names no family.
    ran = cli(
        [
            "run",
            "--stack",
            str(tmp_path / "toy-fast.yaml"),
            "--baseline",
            str(tmp_path / "toy-stock.yaml"),
            "--model",
            str(tmp_path / "toy-small.yaml"),
            "--workload",
            "plug.yaml",
            "--no-mlflow",
            "--json",
        ],
        tmp_path,
        site,
    )
    assert ran.returncode == 0, ran.stderr
    run = json.loads(ran.stdout)
    assert [s["name"] for s in run["stacks"]] == ["toy-stock", "toy-fast"]
    assert all(s["status"] == "ok" for s in run["stacks"])
    assert all(len(s["utterances"]) == 2 for s in run["stacks"])


def test_listing_the_plugins_imports_no_model_code() -> None:
    """Every command loads the catalogue (to validate or list stacks); the model packages
    load where an engine is built. transformers, omnivoice, onnx and torch's dynamo took
    7.1 s of a 14.5 s `orchestrate run` refusing an unknown stack on a 2-core VM."""
    heavy = ("transformers", "omnivoice", "onnx", "torch._dynamo", "mlflow")
    code = textwrap.dedent(f"""
        import sys
        from orchestrate.api.registry import catalogue
        cat = catalogue()
        assert not cat.broken, cat.broken
        print(sorted(m for m in {heavy!r} if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported while listing plugins: {out.stdout}"


def test_the_commands_that_read_the_store_import_no_torch() -> None:
    """`runs`, `show`, `queue`, `explorations` and the rest read records: torch, imported
    for a device probe that only CUDA needs, took 3.3 of `orchestrate runs`'s 6.2 s on a
    2-core VM (most tests call the CLI). A command that plans a job still loads it."""
    code = textwrap.dedent("""
        import sys
        from typer.testing import CliRunner
        from orchestrate.cli.app import app
        from orchestrate.api.technique import DeviceCaps
        from orchestrate.api.scheduling import Capabilities
        assert DeviceCaps.probe("cpu").kind == "cpu"
        assert Capabilities.probe("cpu", ("rumik",)).device == "cpu"
        url = "sqlite:///" + sys.argv[1]
        for args in (["runs"], ["queue"], ["explorations"], ["show", "nothing"]):
            CliRunner().invoke(app, [*args, "--db", url])
        print("torch" in sys.modules)
    """)
    with tempfile.TemporaryDirectory() as folder:
        db = str(Path(folder) / "o.db")
        out = subprocess.run(
            [sys.executable, "-c", code, db], capture_output=True, text=True, timeout=300
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
