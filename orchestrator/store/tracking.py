"""MLflow logging of a recorded run: one parent run per comparison, one child per stack.

Imported lazily (mlflow is slow to import and the worker side never needs it). Runs are
logged through an explicit MlflowClient; the only global state touched is MLflow's own retry
limits (bounded below). The tracking store is $MLFLOW_TRACKING_URI, else ./mlflow.db (SQLite;
no server needed).

MLflow is best effort: the database is written first, `log_run_bounded` gives up after a few
seconds, and `orchestrate sync-mlflow` logs what was missed. A store is created (its schema
migrated) and written under an inter-process lock, so runs started together cannot race
MLflow's store creation (`table _alembic_tmp_experiments already exists`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import mlflow.store.db.utils as mlflow_db_utils
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from orchestrate.api.records import ResultRecord, StackResult, flatten
from orchestrate.store import probes
from orchestrate.store.errors import StoreUnavailable

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_DB = "mlflow.db"
PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs by
# MLflow 3 opens an experiment without this tag as a GenAI one (traces, prompts); the
# model-training view (runs, metrics, registered models) is "custom_model_development".
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
MAX_TAG_CHARS = 5000  # MLflow's limit on a tag value
MAX_PARAM_CHARS = 6000  # MLflow refuses longer param values
BATCH = 100  # MLflow's per-call limit on params and tags
ATTEMPTS, RETRY_PAUSE_S = 2, 1.0  # log_run_bounded's tries, then sync-mlflow takes over
LOCK_WAIT_S = 300.0  # how long to wait for another process logging to the same store
SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQLAlchemy stores

# MLflow's own retries: 10 attempts (~100 s of sleeps) to open a SQL store and 7 HTTP retries
# with backoff factor 2 (minutes), each time for a store that is misconfigured, not flaky.
# Bounded here (users' own environment settings win); log_run_bounded retries briefly.
mlflow_db_utils.MAX_RETRY_COUNT = min(mlflow_db_utils.MAX_RETRY_COUNT, 2)
for _knob, _value in (
    ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1"),
    ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
    ("MLFLOW_HTTP_REQUEST_TIMEOUT", "10"),
):
    os.environ.setdefault(_knob, _value)
# On a tracking server MLflow prints "View run ... at: URL" to stdout for every run it ends:
# a command's output is its own (`run --json` must stay JSON); the run ids are recorded.
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def log_file() -> Path:
    """Where MLflow's own log lines go: beside a local SQLite tracking store
    (mlflow.db -> mlflow.db.log), else in the temp folder."""
    uri = tracking_uri()
    if uri.startswith("sqlite:///") and "?" not in uri:
        return Path(uri.removeprefix("sqlite:///") + ".log")
    return Path(tempfile.gettempdir()) / "orchestrate-mlflow.log"


def quiet_mlflow() -> None:
    """MLflow's and alembic's log records go to `log_file()`, never to the terminal: a
    command's output is its own lines (a failure to log is one warning, log_to_mlflow's).
    Called before each store is opened, as the tracking URI (so the file) may change."""
    handler = logging.FileHandler(log_file(), delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("mlflow", "alembic"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
            old.close()
        logger.addHandler(handler)
        logger.propagate = False


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else a SQLite file in the current directory.

    MLflow 3 already defaults to sqlite:///mlflow.db, but falls back to ./mlruns files when
    that folder holds old runs; ours is fixed so runs always land in one place.
    """
    return probes.tracking_uri()  # one definition: open_store checks it against the database


# Tracking URIs whose store this process has opened (so created and migrated, under the lock).
_opened: set[str] = set()


def client() -> MlflowClient:
    """A client of the tracking store; the first in a process opens the store under the lock,
    as opening creates or migrates it."""
    uri = tracking_uri()
    if uri in _opened:
        return MlflowClient(tracking_uri=uri)
    quiet_mlflow()
    with store_lock(uri):
        mlf = MlflowClient(tracking_uri=uri)  # builds the store: creates or migrates it
    _opened.add(uri)
    return mlf


def target() -> probes.Target:
    return probes.Target(
        "MLflow store",
        tracking_uri(),
        "set MLFLOW_TRACKING_URI or pass --no-mlflow",
        "set MLFLOW_TRACKING_URI to a new file",
    )


def probe() -> None:
    """Raise StoreUnavailable (one line) unless the tracking store opens and can be read;
    run before a worker starts, so a bad MLFLOW_TRACKING_URI costs no measurement."""
    where = target()
    scheme = where.url.split(":", 1)[0].split("+", 1)[0] if ":" in where.url else ""
    if scheme in SQL_SCHEMES:
        probes.check_url(where, create_parent=True)  # as for the run database
    elif scheme in ("", "file"):  # a folder of runs (MLflow's file store)
        path = Path(where.url.removeprefix("file://").removeprefix("file:"))
        probes.check_folder(path, f"{where.what}", where.fix)
    try:
        client().search_experiments(max_results=1)
    except Exception as exc:
        raise probes.unavailable(exc, where) from exc


@contextmanager
def store_lock(uri: str | None = None) -> Iterator[None]:
    """Hold an inter-process lock keyed by the tracking URI (a file in the temp folder, so
    it works when the store's own folder is read-only or remote). Not re-entrant."""
    key = hashlib.sha256((uri or tracking_uri()).encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"orchestrate-mlflow-{key}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's lock file: flock needs only a read descriptor
        fd = os.open(path, os.O_RDONLY)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreUnavailable(
                        f"MLflow store {uri} stayed locked by another orchestrate process for "
                        f"{LOCK_WAIT_S:.0f} s (lock file {path})"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def log_run_bounded(
    result: ResultRecord,
    run_id: str,
    comparisons: dict[str, dict[str, float]] | None = None,
    result_path: Path | None = None,
    audio_dir: Path | None = None,
) -> tuple[str, dict[str, str]]:
    """log_run under the store lock, tried twice RETRY_PAUSE_S apart (a blip, not an outage:
    sync-mlflow is for those); returns the parent MLflow run id and the stacks' child ids.
    A failed attempt's MLflow runs are left FAILED."""
    for attempt in range(ATTEMPTS):
        try:
            client()  # opens (creates) the store under the lock, outside the logging lock
            with store_lock():  # one writer per store: SQLite stores fail under contention
                parent = log_run(result, run_id, comparisons, result_path, audio_dir)
                return parent, stack_run_ids(parent)
        except StoreUnavailable:
            raise
        except Exception:
            if attempt + 1 == ATTEMPTS:
                raise
            time.sleep(RETRY_PAUSE_S)
    raise AssertionError("unreachable")


def experiment_name(result: ResultRecord) -> str:
    return f"orchestrate/{result.job.model.family}/{result.job.workload.name}"


def log_run(
    result: ResultRecord,
    run_id: str,
    comparisons: dict[str, dict[str, float]] | None = None,
    result_path: Path | None = None,
    audio_dir: Path | None = None,
) -> str:
    """Log `result` (store run `run_id`) to MLflow; returns the parent MLflow run id.

    Relative utterance audio paths are resolved against `audio_dir` (else the cwd).
    """
    mlf = client()
    experiment_id = _experiment_id(mlf, experiment_name(result))
    job, env = result.job, result.environment
    tags = {
        "run_id": run_id,
        "job_id": job.job_id,
        "family": job.model.family,
        "workload": job.workload.name,
        "device": job.model.device,
        "device_name": env.device_name,
        "host": env.hostname,
        "status": result.status,
        "code_sha": job.code_sha or env.git_sha or "unknown",
        "protocol_hash": job.protocol.content_hash(),
        "protocol_version": str(job.protocol.version),
        "baseline": job.baseline.name,
        "stacks": ",".join(s.name for s in job.stacks),
    }
    if job.code_sha or env.git_sha:
        tags["mlflow.source.git.commit"] = job.code_sha or env.git_sha or ""
    parent = mlf.create_run(experiment_id, run_name=f"run-{run_id[:8]}", tags=tags)
    parent_id = parent.info.run_id
    children: list[str] = []
    try:
        _log_batch(mlf, parent_id, params=shared_params(result))
        if result.error:
            mlf.set_tag(parent_id, "error", result.error[:5000])
        if result_path is not None and Path(result_path).exists():
            mlf.log_artifact(parent_id, str(result_path))
        for position, sr in enumerate(result.results):
            extra = (comparisons or {}).get(sr.stack.name, {})
            child = mlf.create_run(
                experiment_id,
                run_name=sr.stack.name,
                tags={PARENT_TAG: parent_id, **_stack_tags(sr, position, run_id, extra)},
            )
            children.append(child.info.run_id)
            _log_child(mlf, child.info.run_id, result, sr, extra, audio_dir)
            failed = sr.status in ("failed", "refused")
            mlf.set_terminated(child.info.run_id, "FAILED" if failed else "FINISHED")
    except BaseException:
        for mlflow_id in [*children, parent_id]:
            with suppress(Exception):  # keep the original error, not a follow-up one
                mlf.set_terminated(mlflow_id, "FAILED")
        raise
    mlf.set_terminated(parent_id, "FAILED" if result.status == "failed" else "FINISHED")
    return parent_id


def shared_params(result: ResultRecord) -> dict[str, str]:
    """Model and workload settings every stack of the run shares."""
    model, workload = result.job.model, result.job.workload
    params = {
        "model.family": model.family,
        "model.preset": model.preset,
        "model.dtype": model.dtype,
        "model.device": model.device,
        "model.weights": model.weights or "random",
        "model.init_seed": model.init_seed,
        "workload.name": workload.name,
        "workload.prompts": len(workload.prompts),
        "workload.seeds": workload.seeds,
        "workload.voice": workload.voice,
        "workload.warmups": workload.warmups,
        **flatten(workload.sampling.model_dump(), "workload.sampling"),
        **flatten(workload.length_policy.model_dump(), "workload.length_policy"),
        "protocol.hash": result.job.protocol.content_hash(),
        "strict": result.job.strict,
    }
    return {k: _param_value(v) for k, v in params.items()}


def technique_params(sr: StackResult) -> dict[str, str]:
    """`technique.<i>.name` for the order, `technique.<name>.<param>` for settings."""
    params: dict[str, Any] = {
        "stack.name": sr.stack.name,
        "stack.techniques": len(sr.stack.techniques),
    }
    for i, tech in enumerate(sr.stack.techniques):
        params[f"technique.{i}.name"] = tech.name
        params.update(flatten(tech.params, f"technique.{tech.name}"))
    return {k: _param_value(v) for k, v in params.items()}


def _log_child(
    mlf: MlflowClient,
    child_id: str,
    result: ResultRecord,
    sr: StackResult,
    extra: dict[str, float],
    audio_dir: Path | None,
) -> None:
    metrics = {**_stack_measurements(sr), **sr.metrics, **extra}
    _log_batch(
        mlf, child_id, params={**shared_params(result), **technique_params(sr)}, metrics=metrics
    )
    for path in _audio_files(sr, result.job.workload.save_audio, audio_dir):
        mlf.log_artifact(child_id, str(path), artifact_path="audio")


def _stack_tags(
    sr: StackResult, position: int, run_id: str, extra: dict[str, float]
) -> dict[str, str]:
    # The measured verdict (runner.comparisons' exactness_failed, among the stored metrics
    # when re-logged), not only the plugin's claim: "exact" must not tag a failed stack.
    failed = {**sr.metrics, **extra}.get("exactness_failed")
    tags = {
        "run_id": run_id,
        "stack": sr.stack.name,
        "stack_hash": sr.stack.content_hash(),
        "position": str(position),
        "baseline": str(position == 0).lower(),
        "status": sr.status,
        "exact": str(sr.exact).lower(),
        "exactness": "failed" if failed else "exact" if sr.exact else "approximate",
        "applied": ", ".join(sr.applied) or "none",
        "skipped": "; ".join(f"{k}: {v}" for k, v in sr.skipped.items()) or "none",
    }
    if sr.error:
        tags["error"] = sr.error[:5000]
    return tags


def _stack_measurements(sr: StackResult) -> dict[str, float]:
    """Setup cost, memory and fidelity (the worker's own metrics take precedence)."""
    out: dict[str, float] = {"setup_s": sr.setup_s, "warmup_s": sr.warmup_s}
    if sr.peak_memory_bytes is not None:
        out["peak_memory_bytes"] = float(sr.peak_memory_bytes)
    if sr.fidelity is not None:
        for key, value in sr.fidelity.model_dump().items():
            # Noise floors exist for half precision only; what it covered is not a number.
            if isinstance(value, int | float):
                out[f"fidelity.{key}"] = float(value)
    return out


def _audio_files(sr: StackResult, limit: int, audio_dir: Path | None) -> Iterator[Path]:
    """Up to `limit` existing WAVs of the stack (missing files are skipped, not fatal)."""
    found = 0
    for utt in sr.utterances:
        if found >= limit:
            return
        if not utt.audio_path:
            continue
        path = Path(utt.audio_path)
        if not path.is_absolute() and audio_dir is not None:
            path = Path(audio_dir) / path
        if path.is_file():
            found += 1
            yield path


def _experiment_id(mlf: MlflowClient, name: str) -> str:
    found = mlf.get_experiment_by_name(name)
    if found is not None:
        if EXPERIMENT_KIND_TAG not in found.tags:  # made before the kind was set: set it once
            mlf.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return found.experiment_id
    try:
        return mlf.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except MlflowException:  # created by a concurrent orchestrator meanwhile
        found = mlf.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _log_batch(
    mlf: MlflowClient,
    run_id: str,
    params: dict[str, str] | None = None,
    metrics: dict[str, float] | None = None,
) -> None:
    now = int(time.time() * 1000)
    param_list = [Param(k, v) for k, v in (params or {}).items()]
    metric_list = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()]
    for chunk in _chunks(param_list, BATCH):
        mlf.log_batch(run_id, params=chunk)
    for chunk in _chunks(metric_list, 10 * BATCH):
        mlf.log_batch(run_id, metrics=chunk)


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    return (items[i : i + size] for i in range(0, len(items), size))


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:MAX_PARAM_CHARS]


# ------------------------------------------------------------------------ reading back


def stack_run_ids(parent_id: str) -> dict[str, str]:
    """Stack name -> child MLflow run id, for a parent logged by log_run."""
    mlf = client()
    parent = mlf.get_run(parent_id)
    children = mlf.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_id}'"
    )
    return {c.data.tags["stack"]: c.info.run_id for c in children}


def read_back(mlflow_run_id: str) -> dict[str, Any]:
    """A logged run as plain data: params, metrics, tags, artifacts, and its children's."""
    mlf = client()
    out = _run_data(mlf, mlflow_run_id)
    out["experiment"] = mlf.get_experiment(out["experiment_id"]).name
    out["children"] = {
        name: _run_data(mlf, child) for name, child in stack_run_ids(mlflow_run_id).items()
    }
    return out


def _run_data(mlf: MlflowClient, run_id: str) -> dict[str, Any]:
    run = mlf.get_run(run_id)
    return {
        "run_id": run_id,
        "name": run.info.run_name,
        "status": run.info.status,
        "experiment_id": run.info.experiment_id,
        "params": dict(run.data.params),
        "metrics": dict(run.data.metrics),
        "tags": dict(run.data.tags),
        "artifacts": sorted(_artifacts(mlf, run_id, None)),
    }


def _artifacts(mlf: MlflowClient, run_id: str, path: str | None) -> Iterator[str]:
    for info in mlf.list_artifacts(run_id, path):
        if info.is_dir:
            yield from _artifacts(mlf, run_id, info.path)
        else:
            yield info.path


# --------------------------------------------------------------------------- decisions


def decision_tags(reasons: dict[str, Any]) -> dict[str, str]:
    """A gate decision (its stored reasons: research.decide's verdict dict and evidence) as
    tags: verdict, causes, flags and what was overridden, whether quality was judged, each
    quality gate's line, and the headline it was decided on with its label and CI."""
    headline = reasons.get("decision_headline") or {}
    tags = {
        "gate.verdict": reasons.get("verdict", "?"),
        "gate.causes": "; ".join(f"{k}: {v}" for k, v in (reasons.get("causes") or {}).items()),
        "gate.flags": "; ".join(reasons.get("flags") or []),
        "gate.overridden": "; ".join(reasons.get("overridden") or []),
        "gate.quality": reasons.get("quality") or "judged",
        "gate.headline": headline.get("label", "none"),
    }
    if "speedup_paired" in headline:
        ci = [headline.get(f"speedup_paired_{k}") for k in ("lo", "hi")]
        tags["gate.speedup_paired"] = f"{headline['speedup_paired']:.4g}"
        if None not in ci:
            tags["gate.speedup_paired_ci"] = f"[{ci[0]:.4g}, {ci[1]:.4g}]"
    for g in reasons.get("gates") or []:
        status = "ok" if g["passed"] else "FAIL" if g["passed"] is False else None
        tags[f"gate.quality.{g['metric']}"] = f"{status} {g['why']}" if status else g["why"]
    return {k: (v or "none")[:MAX_TAG_CHARS] for k, v in tags.items()}


def decision_metrics(reasons: dict[str, Any]) -> dict[str, float]:
    """The numbers of a gate decision: the headline it was decided on and its CI, each speed
    check, and the quality scores of the gates it judged (none on random weights: those are
    not meaningful, and the tags say so)."""
    headline = reasons.get("decision_headline") or {}
    out = {f"gate.{k}": float(v) for k, v in headline.items() if k.startswith("speedup_paired")}
    out["gate.accepted"] = float(reasons.get("verdict") == "accept")
    for check in reasons.get("speed") or []:
        if check["n_pairs"]:
            for key in ("speedup", "ci_low", "ci_high"):
                out[f"gate.{check['phase']}.{key}"] = float(check[key])
    for g in reasons.get("gates") or []:
        if g["passed"] is None:
            continue
        for key, value in (("", g["candidate"]), (".stock", g["stock"]), (".delta", g["delta"])):
            if value is not None:
                out[f"quality.{g['metric']}{key}"] = float(value)
    return out


def log_decision(stack_run_id: str, reasons: dict[str, Any]) -> None:
    """Put a gate decision on the stack's MLflow run (the run that was gated)."""
    mlf = client()
    with store_lock():
        tags = [RunTag(k, v) for k, v in decision_tags(reasons).items()]
        for chunk in _chunks(tags, BATCH):
            mlf.log_batch(stack_run_id, tags=chunk)
        _log_batch(mlf, stack_run_id, metrics=decision_metrics(reasons))


# --------------------------------------------------------------------------- champions


def mark_champion(name: str, stack_run_id: str, tags: dict[str, str]) -> str:
    """Register `stack_run_id` (a stack's MLflow run) as a new version of registered model
    `name` and move the `champion` alias to it; tag the run. Returns models:/name@champion.

    The registry holds no model files here: a version points at the run whose params name
    the stack, which is what a deployment needs to rebuild it.
    """
    mlf = client()
    with suppress(MlflowException):  # exists already: one registered model per key
        mlf.create_registered_model(
            name, description="Accepted stacks (orchestrate gate); alias `champion` = current."
        )
    version = mlf.create_model_version(
        name, source=f"runs:/{stack_run_id}", run_id=stack_run_id, tags=tags
    )
    mlf.set_registered_model_alias(name, "champion", version.version)
    mlf.set_tag(stack_run_id, "champion", "true")
    return f"models:/{name}@champion"


def champion_version(name: str) -> dict[str, Any]:
    """The version the `champion` alias points at (run id, tags), for checks and reports."""
    mv = client().get_model_version_by_alias(name, "champion")
    return {"version": mv.version, "run_id": mv.run_id, "tags": dict(mv.tags)}
