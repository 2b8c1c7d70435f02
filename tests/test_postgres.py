"""The store on a real PostgreSQL server (issue 32): the same schema as on SQLite, fresh
databases migrated once when opened together, two drivers sharing one queue, and a bad URL
or a missing driver refused in one line. The store's own tests run on both databases
(their `db_url` parameter, tests/pg_server.py); these are the server's own cases.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pg_server import PASSWORD, PgServer
from sqlalchemy import inspect

from orchestrate import db
from orchestrate.store import probes
from orchestrate.store.store import Store, StoreUnavailable

# ----------------------------------------------------------------------------- schema


def schema(url: str) -> dict[str, Any]:
    """Tables as both databases can be compared: columns (generic type, length, nullable),
    keys, indexes, unique and check constraints by name."""
    engine = db.make_engine(url)
    try:
        found = inspect(engine)
        return {t: _table(found, t) for t in sorted(found.get_table_names())}
    finally:
        engine.dispose()


def _table(found: Any, table: str) -> dict[str, Any]:
    unique = sorted(
        (u["name"], tuple(u["column_names"])) for u in found.get_unique_constraints(table)
    )
    return {
        "columns": [
            (c["name"], _generic(c["type"]), getattr(c["type"], "length", None), c["nullable"])
            for c in found.get_columns(table)
        ],
        "primary_key": found.get_pk_constraint(table)["constrained_columns"],
        "foreign_keys": sorted(
            (
                f["name"],
                tuple(f["constrained_columns"]),
                f["referred_table"],
                f["options"].get("ondelete"),
            )
            for f in found.get_foreign_keys(table)
        ),
        # PostgreSQL also lists the index behind each unique constraint; SQLite does not.
        "indexes": sorted(
            (i["name"], tuple(i["column_names"]), bool(i["unique"]))
            for i in found.get_indexes(table)
            if (i["name"], tuple(i["column_names"])) not in unique
        ),
        "unique": unique,
        "checks": sorted(c["name"] for c in found.get_check_constraints(table)),
    }


def _generic(column_type: Any) -> str:
    # sa.Float is REAL (8 bytes) on SQLite and double precision on PostgreSQL: the same.
    name = type(column_type.as_generic()).__name__
    return "Float" if name == "Double" else name


def test_sqlite_and_postgresql_migrate_to_the_same_schema(pg_url: str, tmp_path: Path) -> None:
    lite = f"sqlite:///{tmp_path / 'o.db'}"
    for url in (lite, pg_url):
        db.migrate(url)
    on_sqlite, on_postgresql = schema(lite), schema(pg_url)
    assert set(on_sqlite) == set(on_postgresql)
    for table, expected in on_sqlite.items():
        assert on_postgresql[table] == expected, table
    runs = on_postgresql["runs"]
    assert ("started_at", "DateTime", None, False) in runs["columns"]
    assert runs["checks"] == ["ck_runs_ck_runs_status"]  # (the naming convention doubles it)


def test_a_fresh_database_opened_at_once_is_migrated_once(pg_url: str) -> None:
    """Four connections upgrade one empty database at once: db.upgrade's advisory lock
    makes three wait and find it at head (without it, CREATE TABLE races: duplicate key in
    pg_type). Plain transactions, not db.writer's: upgrade is safe on its own."""
    barrier, errors = threading.Barrier(4), []

    def open_it() -> None:
        engine = db.make_engine(pg_url)
        try:
            barrier.wait()
            with engine.begin() as conn:
                db.upgrade(conn)
        except Exception as exc:  # collected: an assertion in a thread is lost
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    engine = db.make_engine(pg_url)
    with engine.connect() as conn:
        versions = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalars().all()
    engine.dispose()
    assert versions == [db.head_revision()]


# ------------------------------------------------------------------------------ queue

DRIVER = """
import json, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from factories import fabricate_result
from orchestrate.api.scheduling import Capabilities, Requirements
from orchestrate.store.store import Store

url, name, ready = sys.argv[1], sys.argv[2], Path(sys.argv[4])
cpu, total = Capabilities(device="cpu", families=("rumik",)), 2 * 20
job = fabricate_result().job
store = Store(url)
ready.joinpath(name).touch()
while len(list(ready.iterdir())) < 2:  # both drivers open: then both submit and claim
    time.sleep(0.01)
claimed = []

def claim():  # a worker of this driver, with its own connections
    mine, deadline = Store(url), time.monotonic() + 60
    while time.monotonic() < deadline:
        got = mine.claim_job(f"{name}-worker", cpu)
        if got is not None:
            claimed.append(got.job_id)
        elif mine.count("jobs") == total:
            break  # every job is queued and none is left to claim
        else:
            time.sleep(0.005)

worker = threading.Thread(target=claim)
worker.start()
submitted = [
    store.enqueue(job.model_copy(update={"job_id": f"{name}-{i:02d}"}),
                  Requirements(family="rumik", device="cpu"))
    for i in range(20)
]
worker.join()
print(json.dumps({"submitted": submitted, "claimed": claimed}))
"""


def test_two_drivers_submitting_and_claiming_at_once_lose_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    """Two processes each queue 20 jobs while each runs a claimer: all 40 are queued, and
    each is claimed exactly once (FOR UPDATE SKIP LOCKED under db.writer's lock)."""
    db.migrate(pg_url)  # both drivers then open a migrated database, as a team's would
    ready = tmp_path / "ready"
    ready.mkdir()
    tests_dir = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DRIVER, pg_url, name, tests_dir, str(ready)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    done = [json.loads(out) for out, _ in outs]
    submitted = [j for d in done for j in d["submitted"]]
    claimed = Counter(j for d in done for j in d["claimed"])
    assert len(set(submitted)) == 40
    assert claimed == Counter(submitted)  # every job, each exactly once
    with Store(pg_url) as store:
        jobs = store.list_jobs(limit=100)
    assert len(jobs) == 40
    assert {(j["state"], j["attempts"]) for j in jobs} == {("RUNNING", 1)}
    # What overlapped (printed, not asserted: a loaded machine may serialise the drivers).
    took = {d["submitted"][0][0]: dict(Counter(j[0] for j in d["claimed"])) for d in done}
    first_claim = min(j["claimed_at"] for j in jobs)
    last_submit = max(j["submitted_at"] for j in jobs)
    print(
        f"jobs each driver's claimer took, by submitter: {took}; first claim "
        f"{(last_submit - first_claim).total_seconds():.2f} s before the last submission"
    )


# -------------------------------------------------------------------------- bad input


def _without(module: str, args: list[str]) -> list[str]:
    """The CLI with `args`, run as if `module` were not installed."""
    code = (
        f"import sys, runpy; sys.modules[{module!r}] = None; "
        "sys.argv = ['orchestrate', *sys.argv[1:]]; "
        "runpy.run_module('orchestrate.cli', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code, *args]


def test_a_bad_postgresql_url_or_missing_driver_is_one_line(
    pg_server: PgServer, tmp_path: Path
) -> None:
    """A wrong password, an unknown database, psycopg not installed: each one line naming
    what failed and what to do, password masked, exit 2, nothing created or written."""
    name = pg_server.create_database()
    cli = [sys.executable, "-m", "orchestrate.cli"]
    commands = {
        "password": [*cli, "queue", "--db", pg_server.url(name, password="wrong-pw")],
        "database": [*cli, "queue", "--db", pg_server.url("nosuchdb")],
        "driver": _without("psycopg", ["queue", "--db", pg_server.url(name)]),
    }
    procs = {  # at once: each is mostly the CLI's start-up
        case: subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
        )
        for case, command in commands.items()
    }
    lines = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (case, out, err)
        (lines[case],) = err.strip().splitlines()
        assert out == "" and PASSWORD not in err and "wrong-pw" not in err
    where = f"postgresql+psycopg://orchestrate:***@127.0.0.1:{pg_server.port}"
    assert lines["password"] == (
        f"error: cannot open database {where}/{name}: password authentication failed for "
        'user "orchestrate": check the user and password in the URL; pass --db or set '
        "ORCHESTRATE_DB_URL"
    )
    assert lines["database"] == (
        f'error: cannot open database {where}/nosuchdb: database "nosuchdb" does not exist: '
        f"create it first (createdb -h 127.0.0.1 -p {pg_server.port} -U orchestrate nosuchdb) "
        "or name an existing one; pass --db or set ORCHESTRATE_DB_URL"
    )
    assert lines["driver"] == (
        f"error: database {where}/{name} needs the driver package psycopg[binary] (module "
        "psycopg), which is not installed: pip install 'psycopg[binary]', or name an "
        "installed driver (dialect+driver://); pass --db or set ORCHESTRATE_DB_URL"
    )
    assert pg_server.tables(name) == []  # nothing written, not even the schema
    with pg_server.connect() as conn:  # and the unknown database was not created
        assert conn.execute("SELECT 1 FROM pg_database WHERE datname = 'nosuchdb'").fetchall() == []


def test_mlflow_in_the_orchestrate_database_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow straight on PostgreSQL (no server) must use a database of its own: the same
    database under another user is refused before either opens; another database is fine."""
    ours = "postgresql+psycopg://me:pw1@db.lab:5432/orchestrate"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql+psycopg://ml:pw2@db.lab:5432/orchestrate")
    with pytest.raises(StoreUnavailable, match="MLflow would write its tables into it") as err:
        probes.refuse_shared_tracking(ours)
    assert "pw1" not in str(err.value) and "pw2" not in str(err.value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql+psycopg://ml:pw2@db.lab:5432/mlflow")
    probes.refuse_shared_tracking(ours)
