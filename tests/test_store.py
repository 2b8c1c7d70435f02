"""The run store: schema, round trips, atomicity, duplicates, stale runs, lookups."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import event, inspect, update

from orchestrate import db
from orchestrate.api.records import ResultRecord, utcnow
from orchestrate.api.registry import job_identity as identity_of
from orchestrate.db.models import Base, Metric, Run
from orchestrate.store.rows import classify_failure
from orchestrate.store.store import (
    AmbiguousRun,
    DuplicateRun,
    RunNotFound,
    Store,
    StoreError,
)

MakeResult = Callable[..., ResultRecord]
COMPARISONS = {"fast": {"speedup_vs_baseline": 2.0000001, "rtf_ratio": 0.5}}
TABLES = ("stacks", "stack_results", "utterances", "metrics")
# A CHECK refusing a row, as SQLite and PostgreSQL word it.
CHECK_FAILED = "CHECK constraint failed|violates check constraint"


@pytest.fixture
def url(db_url: str) -> str:
    """A fresh database: a SQLite file, then a PostgreSQL one (tests/pg_server.py)."""
    return db_url


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    with Store(url) as s:
        yield s


def counts(store: Store) -> dict[str, int]:
    return {t: store.count(t) for t in (*TABLES, "runs", "failures")}


def set_run(url: str, run_id: str, **values: object) -> None:
    """Change a run row behind the store's back (to fake other hosts, old rows...)."""
    engine = db.make_engine(url)
    with db.writer(engine).begin() as conn:
        conn.execute(update(Run).where(Run.id == run_id).values(**values))
    engine.dispose()


# ------------------------------------------------------------------------------ schema


def test_an_0004_database_upgrades_keeping_its_candidates_and_takes_superseded(
    url: str,
) -> None:
    # The CHECK on a candidate's decision grew `superseded` in 0005 (compare_metadata does
    # not compare CHECKs): an exploration written at 0004 keeps its rows and takes the new one.
    from alembic import command

    engine = db.make_engine(url)
    with db.writer(engine).begin() as conn:
        command.upgrade(db._alembic_config(conn), "0004")
        conn.exec_driver_sql(
            "INSERT INTO explorations (id, started_at, status, host, family, model_json, "
            "workload_name, workload_json, hardware, protocol_hash, protocol_json, root_json, "
            "champion_json, options_json, jobs, elapsed_s) VALUES ('e1', '2026-12-01', "
            "'FINISHED', 'h', 'rumik', '{}', 'w', '{}', 'cpu', 'p', '{}', '{}', '{}', '{}', 0, 0)"
        )
        conn.exec_driver_sql(
            "INSERT INTO exploration_candidates (exploration_id, seq, status, decision, "
            "proposer, change, proposal_reason, created_at, steps_json, run_ids_json) "
            "VALUES ('e1', 1, 'decided', 'gate', 'ladder', '+x', '', '2026-12-01', '[]', '[]')"
        )
        with pytest.raises(Exception, match=CHECK_FAILED), conn.begin_nested():
            conn.exec_driver_sql(
                "UPDATE exploration_candidates SET decision = 'superseded' WHERE seq = 1"
            )
    engine.dispose()
    db.migrate(url)
    engine = db.make_engine(url)
    with db.writer(engine).begin() as conn:
        conn.exec_driver_sql("UPDATE exploration_candidates SET decision = 'superseded'")
        rows = conn.exec_driver_sql("SELECT seq, decision FROM exploration_candidates").all()
        with pytest.raises(Exception, match=CHECK_FAILED), conn.begin_nested():
            conn.exec_driver_sql("UPDATE exploration_candidates SET decision = 'maybe'")
    engine.dispose()
    assert [tuple(r) for r in rows] == [(1, "superseded")]


def test_migration_matches_models_and_the_database_is_tuned(url: str) -> None:
    db.migrate(url)
    engine = db.make_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], f"db/models.py and the migrations differ: {diff}"
        if engine.dialect.name == "sqlite":
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        else:  # db.writer's lock relies on each statement seeing what committed before it
            isolation = conn.exec_driver_sql("SHOW transaction_isolation").scalar()
            assert isolation == "read committed"
        version = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    assert version == db.head_revision() == "0007"
    assert set(inspect(engine).get_table_names()) >= {
        "runs",
        "stacks",
        "stack_results",
        "utterances",
        "metrics",
        "decisions",
        "failures",
        "jobs",
        "pool_workers",
    }
    engine.dispose()


def test_database_from_a_newer_version_is_refused(url: str) -> None:
    db.migrate(url)
    engine = db.make_engine(url)
    with db.writer(engine).begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0999'")
    engine.dispose()
    with pytest.raises(RuntimeError, match="'0999' is unknown"):
        Store(url)


def test_default_url_is_env_then_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(db.URL_ENV, raising=False)
    assert db.default_url() == "sqlite:///orchestrate.db"
    Store().close()
    assert (tmp_path / "orchestrate.db").is_file()
    monkeypatch.setenv(db.URL_ENV, f"sqlite:///{tmp_path / 'other.db'}")
    with Store() as s:
        assert s.url.endswith("other.db")
    assert (tmp_path / "other.db").is_file()


def test_in_memory_database_works(make_result_record: MakeResult) -> None:
    with Store("sqlite://") as s:
        run_id = s.ingest(make_result_record())
        assert s.get_run(run_id)["status"] == "FINISHED"


def test_worker_side_does_not_import_storage() -> None:
    code = (
        "import sys, orchestrate.api.records, orchestrate.api.config;"
        "bad = [m for m in ('sqlalchemy', 'alembic', 'mlflow', 'db') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------- round trip


def test_begin_then_finish_round_trips_every_field(
    store: Store, make_result_record: MakeResult
) -> None:
    result = make_result_record()
    identity = identity_of(result.job)
    run_id = store.begin_run(result.job, identity)

    running = store.get_run(run_id)
    assert running["status"] == "RUNNING"
    assert running["pid"] == os.getpid()
    assert running["host"] == socket.gethostname()
    assert running["environment"] is None and running["stacks"] == []

    store.finish_run(run_id, result, COMPARISONS, result_path="res/result.json", mlflow_run_id="m1")
    run = store.get_run(run_id[:8])
    assert run["id"] == run_id
    assert run["status"] == "FINISHED"
    assert run["identity"] == identity
    assert run["job_id"] == result.job.job_id
    assert run["family"] == "rumik"
    assert run["workload_name"] == "smoke"
    assert run["baseline_stack"] == "stock"
    assert run["code_sha"] == "0123abcd4567ef"
    assert run["protocol_hash"] == result.job.protocol.content_hash()
    assert run["protocol_version"] == 1
    assert run["result_path"] == "res/result.json"
    assert run["mlflow_run_id"] == "m1"
    assert run["started_at"] == result.started_at
    assert run["ended_at"] == result.finished_at
    assert run["model"] == result.job.model.model_dump(mode="json")
    assert run["workload"] == result.job.workload.model_dump(mode="json")
    assert run["environment"]["device_name"] == "NVIDIA H200"
    assert run["environment"]["packages"] == {"torch": "2.9.0", "numpy": "2.1.0"}

    stock, fast = run["stacks"]
    assert (stock["name"], stock["position"], fast["name"], fast["position"]) == (
        "stock",
        0,
        "fast",
        1,
    )
    assert stock["metrics"] == {
        "rtf": 0.0812345678901,
        "median_latency_s": 0.455,
        "tokens_per_s": 1400.5,
    }
    assert fast["metrics"] == {
        "rtf": 0.0406172839,
        "median_latency_s": 0.2275,
        "tokens_per_s": 2801.0,
        "speedup_vs_baseline": 2.0000001,
        "rtf_ratio": 0.5,
    }
    assert fast["applied"] == ["static_kv_cache@1", "codebook_head@2"]
    assert fast["skipped"] == {"audio_head": "needs CUDA"}
    assert fast["exact"] is False and stock["exact"] is True
    assert fast["fidelity"]["top1_agreement"] == 0.96875
    assert stock["fidelity"] is None
    assert stock["peak_memory_bytes"] == 3 * 2**30 + 7 and fast["peak_memory_bytes"] is None
    assert (fast["setup_s"], fast["warmup_s"]) == (4.5, 2.0)
    assert fast["spec"]["techniques"][0] == {
        "name": "static_kv_cache",
        "params": {"max_len": 512, "graphs": True},
    }

    # Everything the worker produced comes back bit for bit (comparisons aside).
    back = store.get_result(run_id)
    for sr in back.results:
        for key in COMPARISONS.get(sr.stack.name, {}):
            sr.metrics.pop(key)
    assert back == result
    assert back.results[1].utterances[2].prefill_s is None
    assert back.results[0].utterances[1].latency_s == result.results[0].utterances[1].latency_s


def test_stacks_are_shared_between_runs(store: Store, make_result_record: MakeResult) -> None:
    store.ingest(make_result_record())
    store.ingest(make_result_record())
    assert counts(store) == {
        "stacks": 2,
        "stack_results": 4,
        "utterances": 12,
        "metrics": 12,
        "runs": 2,
        "failures": 0,
    }


def test_result_status_maps_and_failed_stacks_reach_the_ledger(
    store: Store, make_result_record: MakeResult
) -> None:
    result = make_result_record(status="partial")
    result.results[1].status = "failed"
    result.results[1].error = "torch.OutOfMemoryError: CUDA out of memory"
    run_id = store.ingest(result)
    assert store.get_run(run_id)["status"] == "PARTIAL"
    [entry] = store.list_failures()
    assert (entry["run_id"], entry["stack_name"], entry["cause"]) == (run_id, "fast", "oom")
    assert "out of memory" in entry["detail"]

    failed = make_result_record(status="failed")
    failed.error = "inductor compile failed"
    failed.results[0].status = "refused"
    failed.results[0].error = None
    failed.results[0].skipped = {"static_kv_cache": "strict: needs CUDA"}
    run_id = store.ingest(failed)
    assert store.get_run(run_id)["status"] == "FAILED"
    entries = {(f["stack_name"], f["cause"]) for f in store.list_failures(run_id=run_id)}
    assert entries == {("stock", "refused"), (None, "compile")}


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        ("CUDA out of memory", "oom"),
        ("torch._dynamo error", "compile"),
        ("KeyError: 'x'", "crash"),
        (None, "other"),
    ],
)
def test_classify_failure(text: str | None, cause: str) -> None:
    assert classify_failure(text) == cause


# ------------------------------------------------------------------------- atomicity


def assert_nothing_but_failed(store: Store, run_id: str, started: object, words: str) -> None:
    run = store.get_run(run_id)
    assert run["status"] == "FAILED"
    assert words in run["error"]
    assert run["environment"] is None, "the result must not be half-recorded"
    assert run["started_at"] == started and run["result_path"] is None
    assert {t: store.count(t) for t in TABLES} == dict.fromkeys(TABLES, 0)
    [entry] = store.list_failures()
    assert entry["run_id"] == run_id and words in entry["detail"]


def test_nan_metric_rolls_back_everything(store: Store, make_result_record: MakeResult) -> None:
    result = make_result_record()
    run_id = store.begin_run(result.job, "id")
    started = store.get_run(run_id)["started_at"]
    with pytest.raises(ValueError, match="non-finite"):
        store.finish_run(run_id, result, {"fast": {"speedup_vs_baseline": math.nan}}, "r.json")
    assert_nothing_but_failed(store, run_id, started, "non-finite")


def test_comparison_clashing_with_a_worker_metric_is_refused(
    store: Store, make_result_record: MakeResult
) -> None:
    result = make_result_record()
    run_id = store.begin_run(result.job, "id")
    started = store.get_run(run_id)["started_at"]
    with pytest.raises(ValueError, match="clash"):
        store.finish_run(run_id, result, {"stock": {"rtf": 1.0}}, "r.json")
    assert_nothing_but_failed(store, run_id, started, "clash")


def test_insert_failing_mid_flush_rolls_back_everything(
    store: Store, make_result_record: MakeResult
) -> None:
    result = make_result_record()
    run_id = store.begin_run(result.job, "id")
    started = store.get_run(run_id)["started_at"]

    def explode(_mapper: object, _conn: object, target: Metric) -> None:
        if target.key == "tokens_per_s":  # after stacks, stack results, utterances
            raise RuntimeError("disk on fire")

    event.listen(Metric, "before_insert", explode)
    try:
        with pytest.raises(RuntimeError, match="disk on fire"):
            store.finish_run(run_id, result, result_path="r.json")
    finally:
        event.remove(Metric, "before_insert", explode)
    assert_nothing_but_failed(store, run_id, started, "disk on fire")

    # The rolled-back result can still be recorded afterwards (e.g. re-ingested).
    assert store.ingest(result) == run_id
    assert store.get_run(run_id)["status"] == "FINISHED"


def test_result_of_another_job_is_refused(store: Store, make_result_record: MakeResult) -> None:
    run_id = store.begin_run(make_result_record().job, "id")
    with pytest.raises(ValueError, match="is job"):
        store.finish_run(run_id, make_result_record())
    assert store.get_run(run_id)["status"] == "FAILED"


# ------------------------------------------------------------------------- duplicates


def test_duplicate_ingest_is_refused(store: Store, make_result_record: MakeResult) -> None:
    result = make_result_record(job_id="job-0001")
    run_id = store.ingest(result, result_path="a.json")
    before = counts(store)
    with pytest.raises(DuplicateRun, match=f"job job-0001 is already recorded as run {run_id}"):
        store.ingest(ResultRecord.model_validate_json(result.model_dump_json()))
    assert counts(store) == before
    assert before["runs"] == 1 and before["stack_results"] == 2


def test_second_finish_is_refused_and_keeps_the_result(
    store: Store, make_result_record: MakeResult
) -> None:
    result = make_result_record()
    run_id = store.begin_run(result.job, "id")
    store.finish_run(run_id, result)
    with pytest.raises(DuplicateRun, match="already has a result"):
        store.finish_run(run_id, result)
    assert store.get_run(run_id)["status"] == "FINISHED"
    assert store.list_failures() == []
    with pytest.raises(DuplicateRun, match="already recorded"):
        store.begin_run(result.job, "id")


def test_ingest_completes_an_interrupted_run(store: Store, make_result_record: MakeResult) -> None:
    result = make_result_record()
    run_id = store.begin_run(result.job, "id")
    with pytest.raises(DuplicateRun, match="being run"):
        store.ingest(result)  # its owner (this process) is alive
    store.fail_run(run_id, "INTERRUPTED", "ctrl-c")
    assert store.get_run(run_id)["status"] == "INTERRUPTED"
    assert store.ingest(result) == run_id
    run = store.get_run(run_id)
    assert (run["status"], run["identity"], run["error"]) == ("FINISHED", "id", None)
    assert [f["cause"] for f in store.list_failures()] == ["interrupted"]


def test_fail_run(store: Store, make_result_record: MakeResult) -> None:
    result = make_result_record()
    run_id = store.begin_run(result.job, "id")
    with pytest.raises(ValueError, match="FAILED or INTERRUPTED"):
        store.fail_run(run_id, "FINISHED", "x")  # type: ignore[arg-type]
    store.fail_run(run_id, "FAILED", "worker exited with code -9")
    run = store.get_run(run_id)
    assert (run["status"], run["error"]) == ("FAILED", "worker exited with code -9")
    assert run["ended_at"] is not None

    # A recorded result is not undone by a later failure (e.g. MLflow logging).
    done = store.ingest(make_result_record())
    store.fail_run(done, "FAILED", "mlflow unreachable")
    assert store.get_run(done)["status"] == "FINISHED"
    assert [f["detail"] for f in store.list_failures()] == [
        "mlflow unreachable",
        "worker exited with code -9",
    ]
    with pytest.raises(RunNotFound):
        store.fail_run("nope", "FAILED", "x")


# ---------------------------------------------------------------------------- stale


def test_run_of_a_killed_orchestrator_becomes_interrupted(
    url: str, tmp_path: Path, make_result_record: MakeResult
) -> None:
    job_file = tmp_path / "job.json"
    make_result_record().job.write(job_file)
    code = (
        "import sys; from pathlib import Path; from orchestrate.store.store import Store;"
        "from orchestrate.api.records import JobSpec;"
        "job = JobSpec.model_validate_json(Path(sys.argv[2]).read_text());"
        "print(Store(sys.argv[1]).begin_run(job, 'ident'))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code, url, str(job_file)], capture_output=True, text=True, check=True
    )
    dead_run = child.stdout.strip()

    with Store(url) as store:  # reconciles on open
        run = store.get_run(dead_run)
        assert run["status"] == "INTERRUPTED"
        assert str(run["pid"]) in run["error"]
        [entry] = store.list_failures()
        assert (entry["run_id"], entry["cause"]) == (dead_run, "interrupted")
        live = store.begin_run(make_result_record().job, "other")
        assert store.reconcile_stale() == []
        assert store.get_run(live)["status"] == "RUNNING"


def test_reused_pid_is_not_mistaken_for_the_owner(
    url: str, store: Store, make_result_record: MakeResult
) -> None:
    if not Path("/proc/self/stat").exists():
        pytest.skip("process start times need /proc")
    run_id = store.begin_run(make_result_record().job, "id")
    # This process is alive but started long after the row: it cannot be the row's owner.
    set_run(url, run_id, started_at=utcnow() - timedelta(days=3))
    assert store.reconcile_stale() == [run_id]
    assert store.get_run(run_id)["status"] == "INTERRUPTED"


def test_runs_of_other_hosts_are_left_alone(
    url: str, store: Store, make_result_record: MakeResult
) -> None:
    run_id = store.begin_run(make_result_record().job, "id")
    set_run(url, run_id, host="some-other-host", pid=2**22 + 12345)
    assert store.reconcile_stale() == []
    assert store.get_run(run_id)["status"] == "RUNNING"


# --------------------------------------------------------------------------- queries


def test_prefix_lookup(
    store: Store, make_result_record: MakeResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = [make_result_record(), make_result_record()]
    ids = iter(["abcd1111" + "0" * 24, "abcd2222" + "0" * 24])
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(next(ids)))  # run ids share "abcd"
    first, second = (store.ingest(r) for r in results)
    with pytest.raises(AmbiguousRun, match="abcd") as err:
        store.get_run("abcd")
    assert first in str(err.value) and second in str(err.value)
    assert store.get_run("ABCD1")["id"] == first
    assert store.get_run(second)["id"] == second
    for bad in ("ffff", "", "%", "abcd_"):
        with pytest.raises(RunNotFound):
            store.get_run(bad)
    assert issubclass(RunNotFound, LookupError) and issubclass(AmbiguousRun, StoreError)


def test_list_runs(store: Store, make_result_record: MakeResult) -> None:
    ids = []
    for hours in (1, 3, 2):
        result = make_result_record()
        result.started_at += timedelta(hours=hours)
        ids.append(store.ingest(result))
    running = store.begin_run(make_result_record().job, "id")  # started now: newest
    runs = store.list_runs()
    assert [r["id"] for r in runs] == [running, ids[1], ids[2], ids[0]]
    assert runs[1]["stacks"] == ["stock", "fast"] and runs[0]["stacks"] == []
    assert [r["id"] for r in store.list_runs(limit=2)] == [running, ids[1]]
    assert store.list_runs(family="omnivoice") == []
    assert len(store.list_runs(family="rumik")) == 4
    assert "model_json" not in runs[0]
    assert runs[1]["model"] == "tiny cpu float32 random"  # the `runs` listing's model column
    json.dumps(runs, default=str)  # plain data, no ORM objects


def test_find_run_by_identity(store: Store, make_result_record: MakeResult) -> None:
    older, newer, partial = (make_result_record() for _ in range(3))
    newer.started_at += timedelta(hours=1)
    partial.started_at += timedelta(hours=2)
    partial.status = "partial"
    identity = identity_of(older.job)
    assert identity == identity_of(newer.job)  # job ids differ, what was measured does not
    ids = [store.ingest(r) for r in (older, newer, partial)]
    found = store.find_run_by_identity(identity)
    assert found is not None and found["id"] == ids[1]
    assert found["stacks"][1]["metrics"]["rtf"] == 0.0406172839
    assert store.find_run_by_identity("nothing") is None
    assert identity_of(make_result_record(code_sha="other").job) != identity


def test_mlflow_ids_are_linked(store: Store, make_result_record: MakeResult) -> None:
    run_id = store.ingest(make_result_record())
    store.set_mlflow_run_ids(run_id, "parent", {"fast": "child-fast"})
    run = store.get_run(run_id)
    assert run["mlflow_run_id"] == "parent"
    assert [s["mlflow_run_id"] for s in run["stacks"]] == [None, "child-fast"]


def test_get_result_needs_a_result(store: Store, make_result_record: MakeResult) -> None:
    run_id = store.begin_run(make_result_record().job, "id")
    with pytest.raises(StoreError, match="no recorded result"):
        store.get_result(run_id)


# ------------------------------------------------------------------------ concurrency


WRITER = """
import sys
sys.path.insert(0, sys.argv[3])
from factories import fabricate_result
from orchestrate.store.store import Store
store = Store(sys.argv[1])
for _ in range(int(sys.argv[2])):
    result = fabricate_result()
    run_id = store.begin_run(result.job, "id")
    store.get_run(run_id)
    store.finish_run(run_id, result)
"""


@pytest.mark.slow
def test_parallel_writers_do_not_hit_locked_database(url: str) -> None:
    tests_dir = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, url, "5", tests_dir], stderr=subprocess.PIPE
        )
        for _ in range(4)
    ]
    errors = [p.communicate()[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    with Store(url) as store:
        assert store.count("runs") == 20 and store.count("stacks") == 2
        assert {r["status"] for r in store.list_runs(limit=50)} == {"FINISHED"}


def test_writers_take_turns_so_a_run_is_resumed_once(
    url: str, store: Store, make_result_record: MakeResult
) -> None:
    """Two `run --resume` of one run, the second while the first is between its check and
    its write: the second waits for the first's transaction, then is refused. SQLite's
    write lock gives that; on PostgreSQL db.writer's advisory lock does (without it both
    checks pass and the run has two resumers)."""
    import threading

    from orchestrate.store.errors import ResumeClaimed
    from orchestrate.store.runs import _refuse_claimed

    job = make_result_record().job
    old = store.begin_run(job, "id")
    store.fail_run(old, "INTERRUPTED", "killed")
    first, second = (
        job.model_copy(update={"job_id": f"{job.job_id}-r{n}", "resumed_from": old}) for n in (2, 3)
    )
    outcome: list[BaseException | str] = []

    def resume_second(other: Store) -> None:
        try:
            outcome.append(other.begin_run(second, "id"))
        except StoreError as exc:
            outcome.append(exc)

    with Store(url) as other:
        with store._write() as s:  # the first resume, checked and not yet written
            _refuse_claimed(s, old)
            thread = threading.Thread(target=resume_second, args=(other,))
            thread.start()
            thread.join(timeout=0.5)
            assert thread.is_alive(), f"the second writer did not wait: {outcome}"
            s.add(store._new_run(first, "id", status="RUNNING", pid=os.getpid()))
        thread.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], ResumeClaimed), outcome
    assert len(store.resumed_by(old)) == 1


def test_a_writer_stuck_behind_another_gives_up_in_one_line(
    url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's busy timeout and PostgreSQL's lock_timeout on db.writer's lock: the same
    wait, then the same line (not a hang, not a traceback)."""
    monkeypatch.setattr(db, "WRITE_LOCK_WAIT_S", 0.3)
    with Store(url) as other, store._write() as s:
        s.connection()  # begins the transaction: takes the write lock
        with pytest.raises(StoreError, match="is locked by another process .*; retry$"):
            other.unregister_worker("nobody")


def test_every_stack_is_also_compared_with_a_declared_second_baseline(make_result_record):
    from orchestrate.running.runner import comparisons

    result = make_result_record()
    stock, fast = result.results
    b = fast.model_copy(
        update={"stack": fast.stack.model_copy(update={"name": "b", "baseline": True})}
    )
    b.utterances = [u.model_copy(update={"latency_s": 2 * u.latency_s}) for u in fast.utterances]
    result = result.model_copy(update={"results": [stock, b, fast]})
    comps = comparisons(result)
    assert comps["fast"]["speedup_vs_baseline"] == pytest.approx(2.0)  # the fixture's scale
    assert comps["fast"]["paired_median_speedup_vs_b"] == pytest.approx(2.0)
    assert comps["b"]["speedup_vs_baseline"] == pytest.approx(1.0)
    assert not any(k.endswith("_vs_b") for k in comps["b"])  # not against itself
