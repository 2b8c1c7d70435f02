"""The run identity covers every input that changes a measurement, and only those."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate.api import registry
from orchestrate.api.config import ModelSpec, Prompt, StackSpec, TechniqueRef, Workload
from orchestrate.api.protocol import Protocol
from orchestrate.api.records import JobSpec
from orchestrate.api.registry import job_identity, source_hash
from orchestrate.running import environment, plan
from orchestrate.running.environment import CodeState, code_state

STOCK = StackSpec(name="stock")
FAST = StackSpec(
    name="fast", techniques=[TechniqueRef(name="static_kv_cache"), TechniqueRef(name="audio_head")]
)
WORKLOAD = Workload(name="w", prompts=[Prompt(id="a", text="Hi.")])


@pytest.fixture
def pinned_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """The working tree as planning sees it, fixed: others may edit files meanwhile."""
    monkeypatch.setattr(plan, "code_state", lambda: CodeState("abc123", True, "d1ff"))


def planned(tmp_path: Path, **kwargs: int) -> JobSpec:
    return plan.plan_job(
        ModelSpec(), WORKLOAD, [STOCK, FAST], Protocol(), tmp_path, check_device=False, **kwargs
    )


def test_identical_plans_share_an_identity(pinned_code, tmp_path):
    a, b = planned(tmp_path), planned(tmp_path)
    assert a.job_id != b.job_id
    assert job_identity(a) == job_identity(b)
    assert set(a.technique_code) == {"static_kv_cache", "audio_head"}
    code = a.technique_code["audio_head"]
    assert code["dist"] == "orchestrate" and code["version"] == 1 and code["source"]
    # recomputed from the record alone, as `ingest` does on another host
    assert job_identity(JobSpec.model_validate_json(a.model_dump_json())) == job_identity(a)


def test_identity_changes_with_fidelity_steps(pinned_code, tmp_path):
    assert job_identity(planned(tmp_path, fidelity_steps=0)) != job_identity(planned(tmp_path))


def test_identity_changes_with_the_uncommitted_diff(tmp_path):
    job = JobSpec(model=ModelSpec(), workload=WORKLOAD, stacks=[STOCK], output_dir="o")
    clean = job.model_copy(update={"code_sha": "abc", "code_dirty": False})
    dirty = clean.model_copy(update={"code_dirty": True, "code_diff_hash": "1111"})
    other = clean.model_copy(update={"code_dirty": True, "code_diff_hash": "2222"})
    assert len({job_identity(clean), job_identity(dirty), job_identity(other)}) == 3
    assert job_identity(dirty) == job_identity(dirty.model_copy(update={"job_id": "again"}))


def test_identity_changes_with_a_techniques_source(pinned_code, tmp_path, monkeypatch):
    before = job_identity(planned(tmp_path))
    real = registry.source_hash
    monkeypatch.setattr(
        registry,
        "source_hash",
        lambda cls: "edited" if cls.name == "audio_head" else real(cls),
    )
    assert job_identity(planned(tmp_path)) != before


def test_source_hash_follows_the_module_file(tmp_path, monkeypatch):
    """An edit to a plugin's module, version unchanged, changes its hash."""
    module = tmp_path / "my_plugin_mod.py"
    body = (
        "from orchestrate.api.technique import Technique\n"
        "class Mine(Technique):\n"
        "    name = 'mine'\n"
        "    version = 1\n"
        "    def apply(self, engine):\n"
        "        return {}\n"
    )
    module.write_text(body)
    spec = importlib.util.spec_from_file_location("my_plugin_mod", module)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "my_plugin_mod", mod)
    spec.loader.exec_module(mod)
    first = source_hash(mod.Mine)
    assert first and first == source_hash(mod.Mine)
    module.write_text(body.replace("return {}", "return {'faster': True}"))
    assert source_hash(mod.Mine) not in (None, first)


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_code_state_hashes_tracked_and_untracked_changes(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / ".gitignore").write_text("ignored.txt\n")
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    monkeypatch.delenv("ORCHESTRATE_CODE_SHA", raising=False)
    monkeypatch.setattr(environment, "REPO_ROOT", repo)

    clean = code_state()
    assert clean.sha and clean.dirty is False and clean.diff_hash is None
    (repo / "ignored.txt").write_text("scratch")
    assert code_state() == clean  # ignored files are not code
    (repo / "a.py").write_text("x = 2\n")
    edited = code_state()
    assert edited.dirty and edited.diff_hash and edited == code_state()
    (repo / "new.py").write_text("y = 1\n")
    with_new = code_state()
    assert with_new.diff_hash not in (None, edited.diff_hash)
    (repo / "new.py").write_text("y = 2\n")
    assert code_state().diff_hash != with_new.diff_hash  # the contents count, not just names
    assert environment.git_state() == (clean.sha, True)


def test_code_sha_from_the_environment_leaves_the_diff_unknown(monkeypatch):
    full = "feed" * 10
    monkeypatch.setenv("ORCHESTRATE_CODE_SHA", full)
    assert code_state() == CodeState(full, None, None)


@pytest.mark.parametrize("bad", ["6bf064e", "FEED" * 10, "feed" * 10 + "\n", "HEAD"])
def test_a_short_or_malformed_code_sha_is_refused(monkeypatch, bad):
    """A short SHA got into committed records (benchmarks/h200/issue14-en20.result.json has
    code_sha 6bf064e): a resume must present the same string, so only a full SHA is taken."""
    monkeypatch.setenv("ORCHESTRATE_CODE_SHA", bad)
    with pytest.raises(ValueError, match="full 40-character commit SHA"):
        code_state()
