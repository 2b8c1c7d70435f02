"""Checks that a database, MLflow store or runs folder can be used; each failure is one line.

They run before anything is opened, so a bad --db, MLFLOW_TRACKING_URI or --runs-dir costs
one line (StoreUnavailable) instead of a traceback, and a file that is not a SQLite database
is never handed to SQLite (which would put a -wal beside it and switch its journal mode).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from orchestrate.store.errors import StoreUnavailable

SQLITE_MAGIC = b"SQLite format 3\x00"
# Module a SQLAlchemy dialect imports -> the package that provides it (pip names).
DRIVER_PACKAGES = {
    "psycopg": "psycopg[binary]",  # with its own libpq (plain psycopg needs the system's)
    "psycopg2": "psycopg2-binary",
    "MySQLdb": "mysqlclient",
    "pymysql": "PyMySQL",
    "pg8000": "pg8000",
    "asyncpg": "asyncpg",
    "oracledb": "oracledb",
    "pyodbc": "pyodbc",
}


@dataclass(frozen=True)
class Target:
    """What is being opened, as the user should read it, and what to do instead."""

    what: str  # "database", "MLflow store"
    url: str
    fix: str  # e.g. "pass --db or set ORCHESTRATE_DB_URL"
    fresh: str  # e.g. "pass --db with a new file"

    @property
    def label(self) -> str:
        return f"{self.what} {display_url(self.url)}"


def database(url: str) -> Target:
    return Target(
        "database", url, "pass --db or set ORCHESTRATE_DB_URL", "pass --db with a new file"
    )


def display_url(url: str) -> str:
    """`url` with any password masked (messages end up in logs and CI output)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


TRACKING_URI_ENV, DEFAULT_TRACKING_DB = "MLFLOW_TRACKING_URI", "mlflow.db"


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else ./mlflow.db (store.tracking says why fixed)."""
    return os.environ.get(TRACKING_URI_ENV) or f"sqlite:///{Path(DEFAULT_TRACKING_DB).resolve()}"


def default_db_url() -> str:
    from orchestrate import db  # the store's own default ($ORCHESTRATE_DB_URL, ./orchestrate.db)

    return db.default_url()


def refuse_shared_tracking(db_url: str) -> None:
    """MLflow's tracking store must not be the orchestrate database: MLflow would create its
    tables (and its own alembic_version) inside it. Checked before either is opened."""
    uri = tracking_uri()
    if _same_database(db_url, uri):
        raise StoreUnavailable(
            f"MLflow's tracking store ({TRACKING_URI_ENV}={display_url(uri)}) is the "
            f"orchestrate database {display_url(db_url)}: MLflow would write its tables into "
            f"it; set {TRACKING_URI_ENV} to another store"
        )


def _same_database(a: str, b: str) -> bool:
    try:
        ua, ub = make_url(a), make_url(b)
    except ArgumentError:
        return False
    fa, fb = sqlite_file(ua), sqlite_file(ub)
    if fa is not None or fb is not None:
        return fa is not None and fb is not None and fa.resolve() == fb.resolve()
    key = ("get_backend_name", "host", "port", "database")
    return all(
        (getattr(ua, k)() if k.startswith("get_") else getattr(ua, k))
        == (getattr(ub, k)() if k.startswith("get_") else getattr(ub, k))
        for k in key
    )


def check_url(target: Target, create_parent: bool = False) -> None:
    """Refuse a URL that cannot work: not a URL, an unknown dialect, a missing driver, or a
    SQLite file SQLite cannot use. Nothing is opened; with `create_parent` (MLflow makes the
    folder of its SQLite file) a missing folder is created."""
    try:
        url = make_url(target.url)
    except ArgumentError:
        hint = (
            f" (for a SQLite file write sqlite:///{target.url})" if "://" not in target.url else ""
        )
        raise StoreUnavailable(
            f"{target.what} URL {target.url!r} is not a URL{hint}; {target.fix}"
        ) from None
    _check_driver(url, target)
    path = sqlite_file(url)
    if path is not None:
        check_sqlite_file(path, target, create_parent)


def database_file(db_url: str) -> Path | None:
    """The file behind a database URL given as text (sqlite_file), or None."""
    return sqlite_file(make_url(db_url))


def sqlite_file(url: URL) -> Path | None:
    """The file behind a SQLite URL; None for other databases, in-memory and URI-mode ones."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    if str(url.query.get("uri", "")).lower() in ("true", "1"):
        return None  # a file: URI with its own options; SQLite reports on it when opened
    return Path(url.database)


def check_sqlite_file(path: Path, target: Target, create_parent: bool = False) -> None:
    """A SQLite file must be a regular, writable file holding a SQLite database (or be
    creatable), in a writable folder (SQLite writes its journal or -wal beside it)."""
    if path.is_dir():
        raise StoreUnavailable(f"{target.label} is a directory, not a database file; {target.fix}")
    if path.exists():
        _check_contents(path, target)
        _check_writable(path, target)
    elif not create_parent and not path.parent.exists():
        raise StoreUnavailable(
            f"cannot open {target.label}: folder {path.parent} does not exist; {target.fix}"
        )
    verb = "open" if path.exists() else "create"
    check_folder(path.parent, f"cannot {verb} {target.label}: folder", target.fix)


def check_folder(path: Path, label: str, fix: str) -> None:
    """Create folder `path` if needed and write (then remove) a probe file in it."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"cannot be made: {p} is a file"
                raise StoreUnavailable(f"{label} {path} {where}, not a folder; {fix}")
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".orchestrate-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StoreUnavailable(f"{label} {path} is not writable{_why(exc)}; {fix}") from exc


def corrupted(target: Target) -> StoreUnavailable:
    return StoreUnavailable(
        f"{target.label} is not a SQLite database (corrupted or not ours): "
        f"restore it from a backup or {target.fresh}"
    )


def unavailable(exc: BaseException, target: Target) -> StoreUnavailable:
    """One line for an error raised while opening or reading a store (the DBAPI's own
    message, never SQLAlchemy's: that one carries the SQL and its parameters)."""
    if isinstance(exc, StoreUnavailable):
        return exc
    if isinstance(exc, ImportError):
        return _missing_driver(exc, target)
    text = first_line(getattr(exc, "orig", None) or exc)
    low = text.lower()
    if "not a database" in low or "malformed" in low:
        return corrupted(target)
    if "readonly" in low or "read-only" in low:
        return StoreUnavailable(f"{target.label} is read-only ({text}); {target.fix}")
    if "locked" in low or "lock timeout" in low:  # held past the wait by another writer
        return StoreUnavailable(f"{target.label} is locked by another process ({text}); retry")
    refused = _server_refusal(text, str(getattr(exc, "orig", None) or exc).lower(), target)
    if refused is not None:
        return refused
    return StoreUnavailable(f"cannot open {target.label}: {text}; {target.fix}")


def _server_refusal(text: str, low: str, target: Target) -> StoreUnavailable | None:
    """A server that refused the connection: a database server (PostgreSQL's words, as
    psycopg passes them on, without their connection preamble) or an MLflow server that
    nothing answers for (`low`: the whole error, lower-cased). None for anything else."""
    said = " ".join(text.rsplit("failed: ", 1)[-1].removeprefix("FATAL:").split())
    try:
        url = make_url(target.url)
    except ArgumentError:
        return None
    where = f"{url.host or 'localhost'}" + (f":{url.port}" if url.port else "")
    if "password authentication failed" in low or ("role" in low and "does not exist" in low):
        fix = "check the user and password in the URL"
    elif "database" in low and "does not exist" in low:
        given = (("-h", url.host), ("-p", url.port), ("-U", url.username))
        createdb = " ".join(["createdb", *(f"{k} {v}" for k, v in given if v), str(url.database)])
        fix = f"create it first ({createdb}) or name an existing one"
    elif "connection refused" in low:
        said = f"nothing listens at {where} (connection refused)"
        fix = "start the server or correct the host and port"
    else:
        return None
    return StoreUnavailable(f"cannot open {target.label}: {said}: {fix}; {target.fix}")


def first_line(exc: object) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _check_driver(url: URL, target: Target) -> None:
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        raise StoreUnavailable(
            f"{target.what} URL {display_url(target.url)}: unknown database kind "
            f"{url.drivername!r}; {target.fix}"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise _missing_driver(exc, target) from exc


def _missing_driver(exc: ImportError, target: Target) -> StoreUnavailable:
    module = (exc.name or "").split(".")[0] or first_line(exc)
    package = DRIVER_PACKAGES.get(module, module)
    named = package if package == module else f"{package} (module {module})"
    install = f"'{package}'" if "[" in package else package  # a shell would glob x[y]
    return StoreUnavailable(
        f"{target.label} needs the driver package {named}, which is not installed: "
        f"pip install {install}, or name an installed driver (dialect+driver://); {target.fix}"
    )


def _check_contents(path: Path, target: Target) -> None:
    """Random bytes, a foreign file or a truncated database: refuse before SQLite sees it."""
    size = path.stat().st_size
    if size == 0:
        return  # SQLite turns an empty file into a new database
    with path.open("rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
        raise corrupted(target)
    page = int.from_bytes(header[16:18], "big")
    page = 65536 if page == 1 else page
    if page < 512 or page & (page - 1):
        raise corrupted(target)
    pages = int.from_bytes(header[28:32], "big")
    counted = pages > 0 and header[24:28] == header[92:96]  # SQLite's own validity rule
    if (size % page or (counted and size < pages * page)) and not _intact(path):
        raise corrupted(target)


def _intact(path: Path) -> bool:
    """SQLite's quick_check on a read-only view of the file, run only when the size already
    looks wrong, as it reads the whole database. With a -wal beside it the view reads the
    log as SQLite does (pages a checkpoint cut short by a full disk are still there);
    without one it is immutable (never written, never locked)."""
    wal = path.with_name(path.name + "-wal")
    mode = "mode=ro" if wal.is_file() and wal.stat().st_size else "immutable=1"
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?{mode}", uri=True)
        try:
            return conn.execute("PRAGMA quick_check(1)").fetchone()[0] == "ok"
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return False


def _check_writable(path: Path, target: Target) -> None:
    try:  # opening for writing changes nothing, not even the file's times
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise StoreUnavailable(
            f"{target.label} is read-only{_why(exc)}: make it writable or "
            f"{target.fresh.replace('a new file', 'a writable copy')}"
        ) from exc
    os.close(fd)


def _why(exc: OSError) -> str:
    # "No such file or directory" for a file that cannot be created in /proc misleads.
    return "" if exc.errno == errno.ENOENT or not exc.strerror else f" ({exc.strerror})"
