"""A real PostgreSQL server for the store tests, loaded by conftest's `pytest_plugins`.

One server per test session (initdb in a temporary folder, pg_ctl start on a free port of
127.0.0.1, stopped at the end even when tests fail), a fresh database per test (CREATE
DATABASE), nothing mocked. `db_url` is the store tests' parameter: the same test runs on a
SQLite file and on the server. Without the server binaries or psycopg the PostgreSQL
parameter skips saying why, and fails in CI (CI=true or ORCHESTRATE_REQUIRE_QUALITY=1),
where .ci/run installs Debian's postgresql package.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# A missing server or driver fails here instead of skipping (a broken CI install must not
# pass as a skip): conftest's flag, or the CI=true that CI runners set.
REQUIRED = (
    os.environ.get("ORCHESTRATE_REQUIRE_QUALITY") == "1"
    or os.environ.get("CI", "").lower() == "true"
)
USER, PASSWORD = "orchestrate", "s3cret-pw"  # scram auth: a wrong password is refused
BACKENDS = ("sqlite", "postgresql")


def bin_dir() -> Path | None:
    """The folder holding initdb and pg_ctl: on PATH, else Debian's newest
    /usr/lib/postgresql/<version>/bin (its package does not put them on PATH)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return versions[-1].parent if versions else None


def _missing() -> str | None:
    """Why no server can be started here, or None."""
    try:
        import psycopg  # noqa: F401  (CREATE DATABASE, and the store's driver)
    except ImportError as exc:
        return f"psycopg cannot be imported ({exc}): pip install -e '.[postgres]'"
    if bin_dir() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql"
    if os.getuid() == 0 and not _has_user("postgres"):
        return "running as root and there is no 'postgres' user to run the server as"
    return None


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PgServer:
    """A running server: its address, superuser and folders."""

    port: int
    root: Path
    bindir: Path
    host: str = "127.0.0.1"

    def url(self, database: str, password: str = PASSWORD, user: str = USER) -> str:
        return f"postgresql+psycopg://{user}:{password}@{self.host}:{self.port}/{database}"

    def connect(self, database: str = "postgres") -> Any:
        """A psycopg connection (autocommit) as the superuser, beside the store's own."""
        import psycopg

        conninfo = f"host={self.host} port={self.port} user={USER} password={PASSWORD}"
        return psycopg.connect(conninfo, dbname=database, autocommit=True)

    def create_database(self) -> str:
        """A new empty database; returns its name."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # a generated name, not input
        return name

    def tables(self, database: str) -> list[str]:
        with self.connect(database) as conn:
            rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            return sorted(r[0] for r in rows)


def _as_server_user(cmd: list[str]) -> list[str]:
    # initdb refuses to run as root; the server then runs as Debian's postgres user.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.getuid() == 0 else cmd


def _start(bindir: Path) -> PgServer:
    # Not under pytest's tmp folder: it is private to root, and the server user must enter.
    root = Path(tempfile.mkdtemp(prefix="orchestrate-pg-"))
    (root / "pw").write_text(PASSWORD + "\n")
    (root / "sock").mkdir()
    if os.getuid() == 0:
        for path in (root, root / "pw", root / "sock"):
            shutil.chown(path, "postgres", "postgres")
    # --no-locale: a CI image's $LANG may name a locale it does not have (initdb fails).
    initdb = [str(bindir / "initdb"), "-D", str(root / "data"), "-U", USER, "-E", "UTF8",
              "--no-locale", "--auth=scram-sha-256", f"--pwfile={root / 'pw'}",
              "--no-sync"]  # fmt: skip
    subprocess.run(_as_server_user(initdb), check=True, capture_output=True, timeout=120)
    for _ in range(3):  # a free port can be taken between asking and binding
        server = PgServer(free_port(), root, bindir)
        # Durability off: a test server's data is thrown away, and fsyncs cost seconds.
        options = (f"-h 127.0.0.1 -p {server.port} -k {root / 'sock'} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off")  # fmt: skip
        start = [str(bindir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "log"),
                 "-w", "-t", "60", "-o", options, "start"]  # fmt: skip
        if subprocess.run(_as_server_user(start), capture_output=True, timeout=90).returncode == 0:
            return server
    log = (root / "log").read_text(errors="replace")[-2000:]
    raise RuntimeError(f"PostgreSQL did not start; its log ends:\n{log}")


def _stop(server: PgServer) -> None:
    stop = [str(server.bindir / "pg_ctl"), "-D", str(server.root / "data"), "-m", "immediate",
            "-w", "stop"]  # fmt: skip
    subprocess.run(_as_server_user(stop), capture_output=True, timeout=60)
    shutil.rmtree(server.root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """The session's server (started on first use), or a skip (a failure in CI) saying why."""
    why = _missing()
    if why is not None:
        if REQUIRED:
            pytest.fail(f"{why}; required here (CI=true or ORCHESTRATE_REQUIRE_QUALITY=1)")
        pytest.skip(why)
    server = _start(bin_dir())  # type: ignore[arg-type]  # _missing checked it
    try:
        yield server
    finally:
        _stop(server)


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """A SQLAlchemy URL of a new, empty database on the session's server."""
    return pg_server.url(pg_server.create_database())


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database of each kind: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'o.db'}"
    return request.getfixturevalue("pg_url")
