"""A GPU host needs only the worker side: torch, transformers, pydantic, pyyaml (and numpy).
A job runs through `python -m orchestrate.running.worker` with the orchestrator's libraries
(SQL, MLflow, Optuna, matplotlib, jiwer, typer, rich) made unimportable; Jinja2 comes with
torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from orchestrate.api.config import ModelSpec, Prompt, StackSpec, Workload
from orchestrate.api.protocol import load_protocol
from orchestrate.running.plan import plan_job

ORCHESTRATOR_SIDE = (
    "sqlalchemy", "alembic", "mlflow", "optuna", "matplotlib", "mpl_toolkits", "jiwer",
    "typer", "rich", "confusables", "rapidfuzz",
)  # fmt: skip
RUN = """
import runpy, site, sys
site.addsitedir(sys.argv.pop(1))  # the worker host's site-packages (and its .pth files)
sys.argv[0] = "worker"
runpy.run_module("orchestrate.running.worker", run_name="__main__")
"""


def worker_host_site(tmp_path: Path) -> Path:
    """This environment's site-packages less the orchestrator side: a link to every entry
    but those packages and their metadata, as a host that never installed them has."""
    import sysconfig

    real = Path(sysconfig.get_paths()["purelib"])
    view = tmp_path / "site"
    view.mkdir()
    for entry in real.iterdir():
        top = entry.name.split("-")[0].lower().removesuffix(".py")
        if top.replace("_", "") in {n.replace("_", "") for n in ORCHESTRATOR_SIDE}:
            continue
        (view / entry.name).symlink_to(entry)
    return view


def test_a_job_runs_on_a_host_with_only_the_worker_side(tmp_path: Path) -> None:
    wl = Workload(
        name="w",
        prompts=[Prompt(id="a", text="A short sentence.")],
        seeds=[42],
        warmups=0,
        length_policy={"mode": "fixed", "frames": 4},
        save_audio=1,
    )
    job = plan_job(
        ModelSpec(preset="tiny"), wl, [StackSpec(name="stock")], load_protocol("protocol"),
        tmp_path, fidelity_steps=0,
    )  # fmt: skip
    view = worker_host_site(tmp_path)
    absent = subprocess.run(  # the view really lacks them
        [sys.executable, "-S", "-c", f"import site; site.addsitedir({str(view)!r}); import mlflow"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert absent.returncode != 0 and "No module named 'mlflow'" in absent.stderr
    job_path, out = tmp_path / "job.json", tmp_path / "result.json"
    job.write(job_path)
    proc = subprocess.run(
        # -S: no site-packages but the view's
        [sys.executable, "-S", "-c", RUN, str(view), str(job_path),
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=os.environ | {"ORCHESTRATE_CODE_SHA": "7" * 40},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["status"] == "finished"
    assert result["results"][0]["utterances"], "nothing was timed"
