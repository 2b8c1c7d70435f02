"""Hostile input II (issue 36): one test per observation, each failing on 444c322.

In-process where the code path allows it (cheap); through the CLI (`refused`: exit 2, one
stderr line) where the observation was about what a user sees. No test here builds a model
except the plugin ones, which run the tiny model for 2 frames with fidelity 4 steps.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from factories import fabricate_result
from factories import run_cli as cli
from pydantic import ValidationError

from orchestrate.api import registry, sealed
from orchestrate.api.config import (
    ConfigError,
    LengthPolicy,
    Prompt,
    StackSpec,
    TechniqueRef,
    Workload,
    load_workload,
)
from orchestrate.api.family import Family, UndeclaredSlot
from orchestrate.api.registry import get_family
from orchestrate.api.technique import Refused, Technique
from orchestrate.families.rumik.engine import HeadLogits, host_loop, stock_engine, stock_sampler
from orchestrate.store.store import Store

WORKLOAD = """\
name: hostile
prompts:
  - {id: a, text: "A short first sentence."}
seeds: [42]
warmups: 0
length_policy: {mode: fixed, frames: 2}
save_audio: 1
measure_ttfa: false
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'runs.db'}",
        "PYTHONUNBUFFERED": "1",
    }


def refused(args: list[str], env: dict[str, str], cwd: Path) -> str:
    """Run a command that must fail with exit 2 and one stderr line; return that line."""
    proc = cli(args, env, cwd)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def workload(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {"name": "w", "prompts": [{"id": "a", "text": "Hello there."}]}
    return base | changes


# ------------------------------------------------------- 1. names that become paths


@pytest.mark.parametrize("bad", ["../../../../elsewhere/owned", "a/b", "..", ".hidden", "a\\b", ""])
def test_1_a_prompt_id_that_is_a_path_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValidationError, match="prompt id .* is not a safe name"):
        Prompt(id=bad, text="Hello.")


@pytest.mark.parametrize("kind", ["workload", "stack"])
def test_1_workload_and_stack_names_must_be_safe(kind: str) -> None:
    with pytest.raises(ValidationError, match=f"{kind} name .* is not a safe name"):
        if kind == "workload":
            Workload.model_validate(workload(name="../up"))
        else:
            StackSpec(name="x/../../y")


def test_1_a_job_id_that_is_a_path_is_refused() -> None:
    from orchestrate.api.records import JobSpec

    job = fabricate_result().job.model_dump(mode="json") | {"job_id": "../../owned"}
    with pytest.raises(ValidationError, match="job_id"):
        JobSpec.model_validate(job)


def test_1_writes_are_checked_to_stay_under_their_root(tmp_path: Path) -> None:
    from orchestrate.api.paths import OutsideRoot, inside

    assert inside(tmp_path, "stock/a_s42.wav") == tmp_path / "stock/a_s42.wav"
    (tmp_path / "link").symlink_to("/tmp")
    for escape in ("../x.wav", "stock/../../x.wav", "/etc/x.wav", "link/x.wav"):
        with pytest.raises(OutsideRoot, match="outside"):
            inside(tmp_path, escape)


def test_1_the_cli_refuses_a_traversing_prompt_id_before_anything(env, tmp_path) -> None:
    evil = WORKLOAD.replace("{id: a,", '{id: "../../../../elsewhere/owned",')
    (tmp_path / "evil.yaml").write_text(evil)
    line = refused(["run", "--stack", "cpu-fast", "--workload", "evil.yaml"], env, tmp_path)
    assert "prompt id '../../../../elsewhere/owned' is not a safe name" in line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "runs.db").exists()


# ------------------------------------------- 2. exactness faked through an undeclared slot

SLOT_WORKLOAD = Workload(
    name="slots",
    prompts=[Prompt(id="a", text="A short first sentence.")],
    seeds=[42],
    length_policy=LengthPolicy(mode="fixed", frames=2),
)
SLOT_STEPS = 16  # two frames of the tiny model's eight codebooks


def _negated(sampler: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`sampler` on negated logits: it draws the least likely tokens, so no sampled token
    is stock's, while the head (all teacher forcing sees) is untouched."""

    def draw(head: HeadLogits, **kw: Any) -> torch.Tensor:
        return sampler(dataclasses.replace(head, logits=-head.logits), **kw)

    return draw


class SneakySampler(Technique):
    """The issue's plugin: declares the head (and assigns it), also replaces the sampler."""

    name = "sneaky_sampler"
    family = "rumik"
    exact = True  # the teacher-forced logits do match: only the sampler changed
    slots = ("head",)  # ... which it does not declare
    summary = "test plugin: declares the head, replaces the sampler"

    def apply(self, engine: Any) -> None:
        engine.head = engine.head
        engine.sampler = _negated(engine.sampler)


class DeclaredSneakySampler(SneakySampler):
    """The same change, declared: built, and its exact claim measured on its draws."""

    name = "declared_sneaky_sampler"
    slots = ("head", "sampler")


def _build(model: Any, technique: type[Technique]) -> Any:
    """`technique` alone on `model`, through the worker's path, as if pip-installed."""
    cat = registry.catalogue()
    fake = registry.Catalogue(
        cat.families, {**cat.techniques, technique.name: technique}, cat.broken
    )
    spec = StackSpec(name="sneaky", techniques=[TechniqueRef(name=technique.name)])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "catalogue", lambda: fake)
        return get_family("rumik").build_engine(model, registry.build_stack(spec))


def test_2_a_technique_changing_a_slot_it_does_not_declare_is_refused(tiny_model) -> None:
    with pytest.raises(Refused) as caught:  # the worker records a Refused stack as refused
        _build(tiny_model, SneakySampler)
    why = str(caught.value)
    assert isinstance(caught.value, UndeclaredSlot) and caught.value.slots == ["sampler"]
    assert why.startswith("technique 'sneaky_sampler' changed the 'sampler' slot, which it ")
    assert "(it declares head)" in why and "\n" not in why


def test_2_the_same_change_declared_is_built_and_measured_not_exact(tiny_model) -> None:
    engine = _build(tiny_model, DeclaredSneakySampler)
    family = get_family("rumik")
    rec = family.fidelity(tiny_model, {"s": engine}, SLOT_WORKLOAD, SLOT_STEPS)["s"]
    assert rec.max_abs_logit_diff == 0 and rec.logits_within_tolerance  # teacher forcing: fine
    assert rec.sampler_tv is not None and rec.sampler_tv_bound is not None
    assert rec.sampler_tv > rec.sampler_tv_bound and not rec.within_tolerance
    assert "sampler" in (rec.covers or [])


@pytest.mark.parametrize("slot", ["sampler", "loop"])
def test_2_fidelity_tests_a_sampler_or_loop_that_is_not_stocks_even_undeclared(
    tiny_model, slot: str
) -> None:
    """An engine built around the slot check (by hand, nothing in `filled`) is still judged
    on what it samples: the slot tests follow the occupant, not the declaration."""

    def reseeded(engine: Any, prompt: list[int], frames: int | None, sampling: Any, gen: Any):
        other = torch.Generator(device=gen.device).manual_seed(gen.initial_seed() + 1)
        return host_loop(engine, prompt, frames, sampling, other)

    engine = stock_engine(tiny_model)
    if slot == "sampler":
        engine.sampler = _negated(stock_sampler)
    else:
        engine.loop = reseeded
    assert engine.filled == {}
    family = get_family("rumik")
    rec = family.fidelity(tiny_model, {"s": engine}, SLOT_WORKLOAD, SLOT_STEPS)["s"]
    assert rec.max_abs_logit_diff == 0 and slot in (rec.covers or [])
    assert not rec.within_tolerance
    if slot == "sampler":
        assert rec.sampler_tv is not None and rec.sampler_tv_bound is not None
        assert rec.sampler_tv > rec.sampler_tv_bound
    else:
        assert rec.loop_tokens_identical is False


class _Toy(Family):
    """A family with nothing but slots: apply_checked needs no model."""

    name = "toy"
    slots = ("head", "sampler", "knob.*")

    def slot_occupants(self, engine: Any) -> dict[str, Any]:
        knobs = {f"knob.{k}": v for k, v in engine.knobs.items()}
        return {**super().slot_occupants(engine), **knobs}

    def _unused(self, *args: Any) -> Any:
        raise AssertionError("not called")

    build_model = config_hash = build_engine = synthesize = step_bytes = fidelity = _unused


def _toy_technique(slots: tuple[str, ...], wraps: tuple[str, ...], apply: Any) -> Technique:
    attrs = {"name": "t", "family": "toy", "exact": True, "slots": slots, "wraps": wraps}
    cls = type("T", (Technique,), {**attrs, "apply": lambda self, e: apply(e)})
    return cls(Technique.Params())


def _set_knob(name: str, value: object) -> Callable[[Any], None]:
    return lambda engine: engine.knobs.__setitem__(name, value)


@pytest.mark.parametrize(
    ("slots", "wraps", "apply", "refused"),
    [
        (("head",), (), lambda e: setattr(e, "head", object()), []),
        ((), ("head",), lambda e: setattr(e, "head", object()), []),
        (("knob.*",), (), _set_knob("speed", 2.0), []),
        (("head",), (), _set_knob("speed", float("1.0")), []),  # equal value: no change
        (("head",), (), _set_knob("speed", 2.0), ["knob.speed"]),
        (("head",), (), _set_knob("pitch", 1.0), ["knob.pitch"]),  # a knob that appears
        ((), (), lambda e: e.knobs.pop("speed"), ["knob.speed"]),  # and one that vanishes
        (
            ("knob.speed",),
            (),
            lambda e: (setattr(e, "head", 1), setattr(e, "sampler", 2)),
            ["head", "sampler"],
        ),
    ],
    ids=[
        "declared",
        "wrapped",
        "declared-glob",
        "equal-value",
        "undeclared-knob",
        "knob-appears",
        "knob-vanishes",
        "two-undeclared",
    ],
)
def test_2_apply_checked_refuses_exactly_the_undeclared_changes(
    slots: tuple[str, ...], wraps: tuple[str, ...], apply: Any, refused: list[str]
) -> None:
    engine = SimpleNamespace(head=object(), sampler=object(), knobs={"speed": 1.0})
    technique = _toy_technique(slots, wraps, apply)
    if not refused:
        _Toy().apply_checked(engine, technique)
        return
    with pytest.raises(UndeclaredSlot) as caught:
        _Toy().apply_checked(engine, technique)
    assert caught.value.slots == refused and caught.value.technique == "t"


# ---------------------------------------------------- 3. the holdout, disguised

H01 = "Quiet violet lanterns drifted above the harbour long after the festival had ended."


def leaks(text: str) -> list[sealed.Leak]:
    held = [sealed.Fingerprint.of("sealed.yaml", Prompt(id="h01", text=H01))]
    dev = Workload(name="dev", prompts=[Prompt(id="d1", text=text)])
    return sealed.find_leaks(dev, held)


def test_3_zero_width_and_bidi_characters_do_not_hide_a_holdout_text() -> None:
    hidden = "\u200b".join(H01)  # a zero-width space between every character
    assert leaks(hidden) and leaks(hidden)[0].how == "exact copy"
    marked = H01.replace(" ", " \u200d\u2066") + "\u2069\ufeff"
    assert leaks(marked)[0].how == "exact copy"


def test_3_cyrillic_look_alikes_do_not_hide_a_holdout_text() -> None:
    swap = str.maketrans({"a": "\u0430", "e": "\u0435", "o": "\u043e", "Q": "Q", "p": "\u0440"})
    disguised = H01.translate(swap)
    assert disguised != H01 and disguised.isascii() is False
    assert leaks(disguised)[0].how == "exact copy"
    assert leaks(H01.upper().replace("O", "\u041e"))[0].how == "exact copy"


def test_3_a_near_duplicate_by_characters_is_refused() -> None:
    # One letter changed in five words: the word ratio (0.62) misses it, characters do not.
    typo = H01.replace("violet", "violot").replace("lanterns", "lanterms")
    typo = typo.replace("drifted", "drifded").replace("harbour", "harbor").replace("ended", "endet")
    found = leaks(typo)
    assert found and found[0].how.startswith("near copy (character ratio")
    assert leaks("The morning train was late again, so I walked along the river.") == []


def test_3_the_digest_is_of_the_normalised_text() -> None:
    fp = sealed.Fingerprint.of("f", Prompt(id="h", text="\u200bHеllo, World!"))
    assert sealed.normalise("Hello, World!") == "hello world"
    assert fp.digest == sealed._short("hello world")


# ------------------------------------------------- 4. and 5. databases


def _corrupt_middle(path: Path) -> None:
    size = path.stat().st_size
    with path.open("r+b") as f:
        for offset in range(2 * 4096, size, 3 * 4096):
            f.seek(offset + 100)
            f.write(b"\xff" * 2000)


def test_4_a_database_corrupted_mid_file_is_one_line_naming_it(env, tmp_path) -> None:
    db = tmp_path / "runs.db"
    with Store(f"sqlite:///{db}") as store:
        ids = [store.ingest(fabricate_result()) for _ in range(20)]
    _corrupt_middle(db)
    for args in (["runs"], ["show", ids[0]]):
        line = refused(args, env, tmp_path)
        assert line.startswith(f"error: database sqlite:///{db} ") and "corrupted" in line


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_5_a_healthy_database_whose_pages_are_in_its_wal_opens(tmp_path: Path) -> None:
    """The disk filled during a checkpoint: page 1 (which names N pages) reached the file,
    later pages did not; every page is still in the -wal. SQLite reads it whole; the check
    must too, and the run whose orchestrator died is then marked INTERRUPTED."""
    live, cut, probe = (tmp_path / d for d in ("live", "cut", "probe"))
    for d in (live, cut, probe):
        d.mkdir()
    store = Store(f"sqlite:///{live / 'o.db'}")
    run_id = store.begin_run(fabricate_result().job, "identity")
    with closing(sqlite3.connect(live / "o.db")) as conn, conn:  # its orchestrator is gone
        conn.execute("UPDATE runs SET pid = ? WHERE id = ?", (_dead_pid(), run_id))
    wal = (live / "o.db-wal").read_bytes()  # every page since the database was made
    store.close()  # the last connection checkpoints: the file now holds all N pages
    whole = (live / "o.db").read_bytes()
    assert len(whole) > 8 * 4096
    for d in (cut, probe):
        (d / "o.db").write_bytes(whole[: len(whole) // 2 // 4096 * 4096])
        (d / "o.db-wal").write_bytes(wal)
    # Precondition: healthy as SQLite sees it.
    with closing(sqlite3.connect(probe / "o.db")) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("SELECT status FROM runs").fetchone()[0] == "RUNNING"

    with Store(f"sqlite:///{cut / 'o.db'}") as store:
        run = store.get_run(run_id, utterances=False)
    assert run["status"] == "INTERRUPTED" and "ended without finishing" in run["error"]


# ------------------------------------------------------------ 6. one resume at a time


def test_6_a_second_resume_of_the_same_run_is_refused_naming_the_first(tmp_path: Path) -> None:
    from orchestrate.store.errors import ResumeClaimed

    store = Store(f"sqlite:///{tmp_path / 'o.db'}")
    job = fabricate_result().job
    old = store.begin_run(job, "identity")
    store.fail_run(old, "INTERRUPTED", "killed")
    first, second = (
        job.model_copy(update={"job_id": f"resume{i}", "resumed_from": old}) for i in (1, 2)
    )
    mine = store.begin_run(first, "identity")  # both planned before either began
    with pytest.raises(ResumeClaimed, match=f"being resumed as run {mine[:12]} by pid \\d+ on"):
        store.begin_run(second, "identity")
    assert [r["id"] for r in store.resumed_by(old)] == [mine]


# -------------------------------------------------------------------------- 7., 9. MLflow


def test_7_a_tracking_uri_naming_the_orchestrate_database_is_refused_first(env, tmp_path) -> None:
    db = tmp_path / "runs.db"
    Store(f"sqlite:///{db}").close()
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{db}"
    line = refused(["run", "--stack", "cpu-fast", "--workload", "wl.yaml"], env, tmp_path)
    assert "is the orchestrate database" in line and str(db) in line
    with closing(sqlite3.connect(db)) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert "runs" in tables and not {"experiments", "latest_metrics", "registered_models"} & tables
    assert not (tmp_path / "runs").exists()


def test_9_mlflows_own_logging_goes_to_its_log_file_not_the_terminal(tmp_path: Path) -> None:
    store = tmp_path / "mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}",
           "MLFLOW_LOGGING_LEVEL": "INFO"}  # fmt: skip
    code = "from orchestrate.store import tracking; tracking.probe()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "mlflow" not in proc.stderr.lower() and "alembic" not in proc.stderr.lower()
    assert "Creating initial MLflow database tables" in (tmp_path / "mlflow.db.log").read_text()


# ------------------------------------------------------------------ 8. disk full


def test_8_a_full_disk_while_writing_a_wav_names_it_and_leaves_no_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrate.running import audio
    from orchestrate.running.worker import disk_full

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write(2) does: no name

    monkeypatch.setattr(audio.os, "write", full)
    wav = tmp_path / "stock" / "a_s42.wav"
    with pytest.raises(OSError) as caught:
        audio.write_wav(wav, np.zeros(240, dtype=np.float32), 24000)
    assert caught.value.errno == errno.ENOSPC
    line = disk_full(caught.value, tmp_path / "result.json")
    assert f"writing {wav}" in line and "result.json" not in line
    assert list((tmp_path / "stock").iterdir()) == []  # no .partial, no WAV


# ---------------------------------------------------------------- 10. exit codes


def test_10_noise_with_too_few_repeats_is_a_bad_option(env, tmp_path) -> None:
    line = refused(["noise", "--repeats", "0", "--workload", "wl.yaml"], env, tmp_path)
    assert line == "error: --repeats must be at least 2 to measure a spread, got 0"
    assert not (tmp_path / "runs.db").exists()


def test_10_an_empty_weights_folder_is_refused_at_planning(env, tmp_path) -> None:
    (tmp_path / "weights").mkdir()
    args = ["run", "--stack", "cpu-fast", "--workload", "wl.yaml", "--model", "weights"]
    line = refused(args, env, tmp_path)
    assert line == f"error: weights folder {tmp_path / 'weights'} is empty"
    assert not (tmp_path / "runs.db").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("seeds, why", [("[-1]", "seed -1 is out of range"),
                                        ("[4294967296]", "seed 4294967296 is out of range"),
                                        ("[7, 7]", "duplicate seeds: [7]")])  # fmt: skip
def test_10_a_bad_seed_is_refused_at_planning(tmp_path: Path, seeds: str, why: str) -> None:
    (tmp_path / "w.yaml").write_text(WORKLOAD.replace("seeds: [42]", f"seeds: {seeds}"))
    with pytest.raises(ConfigError, match=f"seeds: {why}".replace("[", "\\[")):
        load_workload(str(tmp_path / "w.yaml"))


# -------------------------------------------------------------- 11. smaller holes


def test_11_a_yaml_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(WORKLOAD.replace("short", "sh\xf6rt").encode("latin-1"))
    with pytest.raises(ConfigError, match=f"^{path}: not UTF-8 text"):
        load_workload(str(path))


@pytest.mark.parametrize(
    "changes, where",
    [
        ({"prompts": [{"id": f"p{i}", "text": "x"} for i in range(1001)]}, "prompts"),
        ({"prompts": [{"id": "a", "text": "x" * 2001}]}, "prompt 'a' has 2001 characters"),
        ({"save_audio": 10**9}, "save_audio"),
        ({"warmups": 10**6}, "warmups"),
        ({"seeds": list(range(101))}, "seeds"),
        ({"sampling": {"max_new_tokens": 10**12}}, "sampling.max_new_tokens"),
        ({"length_policy": {"frames": 10**9}}, "length_policy.frames"),
    ],
)
def test_11_every_size_a_file_sets_is_bounded(changes: dict, where: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Workload.model_validate(workload(**changes))
    from orchestrate.api.config import explain

    assert where in explain(caught.value)


def test_11_a_user_stack_cannot_shadow_a_built_in_stack(env, tmp_path) -> None:
    (tmp_path / "mine.yaml").write_text("name: cpu-fast\ntechniques: []\n")
    line = refused(["run", "--stack", "mine.yaml", "--workload", "wl.yaml"], env, tmp_path)
    assert "stack 'cpu-fast' from mine.yaml reuses the name of the built-in stack" in line


def test_11_explain_of_a_file_that_is_not_a_stack_does_not_echo_it(env, tmp_path) -> None:
    secret = "password: hunter2\n" + "\n".join(f"line{i}: {i}" for i in range(50))
    (tmp_path / "notes.yaml").write_text(secret)
    line = refused(["explain", "notes.yaml"], env, tmp_path)
    assert "line49" not in line and "notes.yaml" in line  # the first few keys, no more
    (tmp_path / "broken.yaml").write_text("password: hunter2: oops\n" + secret)
    line = refused(["explain", "broken.yaml"], env, tmp_path)
    assert "hunter2" not in line and "line 1, column 18" in line and "broken.yaml" in line


# ---------------------------------------------- plugins written against the README (9, 10)

PLUGIN = """
from orchestrate.api.technique import Technique


class _Crash:
    def __init__(self, inner):
        self.inner = inner
        self.bytes_per_step = getattr(inner, "bytes_per_step", None)

    def __call__(self, hidden, step):
        raise RuntimeError("the head fell over")


class Crasher(Technique):
    name = "crasher"
    version = 1
    family = "rumik"
    exact = True
    slots = ("head",)
    summary = "test plugin: its head raises on the first step"

    def apply(self, engine):
        engine.head = _Crash(engine.head)

"""


@pytest.fixture
def site(tmp_path: Path, env: dict[str, str]) -> Path:
    """The plugin as pip would install it, on a folder only the CLI subprocess sees."""
    site = tmp_path / "site"
    (site / "hostile_plugin").mkdir(parents=True)
    (site / "hostile_plugin" / "__init__.py").write_text(PLUGIN)
    info = site / "hostile_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[orchestrate.techniques]\ncrasher = hostile_plugin:Crasher\n"
    )
    (tmp_path / "crash.yaml").write_text("name: crash\ntechniques: [{name: crasher}]\n")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return site


@pytest.mark.slow
def test_9_10_a_stack_crashing_mid_run_exits_non_zero_without_mlflow_noise(
    env, tmp_path, site
) -> None:
    args = ["run", "--stack", "crash.yaml", "--workload", "wl.yaml", "--fidelity-steps", "0"]
    proc = cli(args, env, tmp_path)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith("error: run ") and "stack crash failed while it ran" in err[-1]
    assert len(err) <= 2, proc.stderr  # at most MLflow's one warning line, then ours
    assert "the head fell over" in proc.stdout  # the stack's own error, in the report
    assert "INFO" not in proc.stderr and "alembic" not in proc.stderr.lower()
