"""An installed wheel finds the shipped stacks, presets and workloads (package data), and a
user's ./experiments and ./configs in the working directory are searched before them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import json, orchestrate.api.config as c
from orchestrate.api.config import load_model_spec, load_stack, load_workload, stack_path
print(json.dumps({
    "shipped": str(c.SHIPPED_ROOT),
    "stack": str(stack_path("exp74-full")),
    "techniques": len(load_stack("exp74-full").techniques),
    "workload": load_workload("gpu-quick").name,
    "model": load_model_spec("rumik-oss-1").preset,
    "mine": str(stack_path("mine")),
}))
"""


@pytest.mark.slow
def test_an_installed_wheel_finds_shipped_configs_after_the_users(tmp_path: Path) -> None:
    import json

    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         str(REPO), "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("orchestrate-*.whl")
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
         str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    work = tmp_path / "work"
    (work / "experiments").mkdir(parents=True)
    (work / "experiments" / "mine.yaml").write_text("name: mine\ntechniques: []\n")
    # The wheel first on the path: ahead of this checkout's editable install.
    env = os.environ | {"PYTHONPATH": str(site)}
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=work, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-2000:]
    found = json.loads(probe.stdout)
    assert Path(found["shipped"]) == site / "orchestrate"  # not the checkout
    assert Path(found["stack"]) == site / "orchestrate" / "experiments" / "exp74-full.yaml"
    assert found["techniques"] > 0
    assert (found["workload"], found["model"]) == ("gpu-quick", "rumik-oss-1")
    assert Path(found["mine"]) == work / "experiments" / "mine.yaml"
