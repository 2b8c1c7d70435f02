"""MLflow logging: one parent per run, one child per stack, read back from a local store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require_or_skip

require_or_skip("mlflow")  # absent on the GPU host (a collection error there); CI requires it

from orchestrate.api.records import ResultRecord  # noqa: E402
from orchestrate.store import tracking  # noqa: E402
from orchestrate.store.store import Store  # noqa: E402

MakeResult = Callable[..., ResultRecord]
RUN_ID = "0123456789abcdef0123456789abcdef"
COMPARISONS = {"fast": {"speedup_vs_baseline": 2.0000001}}


@pytest.fixture(scope="module")
def logged(
    tmp_path_factory: pytest.TempPathFactory, make_result_record: MakeResult
) -> Iterator[dict[str, Any]]:
    """One result logged to a SQLite MLflow store in a temporary folder (the slow part)."""
    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        mp.chdir(root)  # MLflow puts SQLite-store artifacts under ./mlruns
        audio = root / "audio"
        result = make_result_record(audio_dir=audio)
        result_path = root / "result.json"
        result.write(result_path)
        parent = tracking.log_run(result, RUN_ID, COMPARISONS, result_path, audio)
        yield {"root": root, "result": result, "parent": parent, "data": tracking.read_back(parent)}


def test_parent_run(logged: dict[str, Any]) -> None:
    data, result = logged["data"], logged["result"]
    assert data["experiment"] == "orchestrate/rumik/smoke"
    assert data["name"] == "run-01234567"
    assert data["status"] == "FINISHED"
    tags = data["tags"]
    assert tags["run_id"] == RUN_ID
    assert tags["job_id"] == result.job.job_id
    assert tags["family"] == "rumik"
    assert tags["device"] == "cpu"
    assert tags["device_name"] == "NVIDIA H200"
    assert tags["status"] == "finished"
    assert tags["code_sha"] == "0123abcd4567ef"
    assert tags["protocol_hash"] == result.job.protocol.content_hash()
    assert tags["baseline"] == "stock"
    assert data["params"]["model.preset"] == "tiny"
    assert data["artifacts"] == ["result.json"]
    assert sorted(data["children"]) == ["fast", "stock"]


def test_child_params(logged: dict[str, Any]) -> None:
    fast = logged["data"]["children"]["fast"]["params"]
    assert fast["technique.0.name"] == "static_kv_cache"
    assert fast["technique.1.name"] == "codebook_head"
    assert fast["technique.static_kv_cache.max_len"] == "512"
    assert fast["technique.static_kv_cache.graphs"] == "true"
    assert fast["technique.codebook_head.top_k"] == "8"
    assert fast["stack.techniques"] == "2"
    assert (fast["model.preset"], fast["model.dtype"], fast["model.device"]) == (
        "tiny",
        "float32",
        "cpu",
    )
    assert fast["workload.sampling.temperature"] == "0.8"
    assert fast["workload.sampling.top_k"] == "30"
    assert fast["workload.length_policy.mode"] == "fixed"
    assert fast["workload.length_policy.frames"] == "80"
    stock = logged["data"]["children"]["stock"]["params"]
    assert stock["stack.techniques"] == "0"
    assert not any(k.startswith("technique.") for k in stock)


def test_child_metrics(logged: dict[str, Any]) -> None:
    fast = logged["data"]["children"]["fast"]["metrics"]
    assert fast["rtf"] == 0.0406172839
    assert fast["tokens_per_s"] == 2801.0
    assert fast["speedup_vs_baseline"] == 2.0000001
    assert fast["setup_s"] == 4.5
    assert fast["fidelity.top1_agreement"] == 0.96875
    stock = logged["data"]["children"]["stock"]["metrics"]
    assert stock["rtf"] == 0.0812345678901
    assert stock["peak_memory_bytes"] == 3 * 2**30 + 7
    assert "speedup_vs_baseline" not in stock


def test_child_tags(logged: dict[str, Any]) -> None:
    children = logged["data"]["children"]
    fast, stock = children["fast"]["tags"], children["stock"]["tags"]
    assert fast["mlflow.parentRunId"] == logged["parent"]
    assert (fast["exact"], fast["exactness"], stock["exactness"]) == (
        "false",
        "approximate",
        "exact",
    )
    assert fast["skipped"] == "audio_head: needs CUDA"
    assert fast["applied"] == "static_kv_cache@1, codebook_head@2"
    assert (fast["status"], fast["baseline"], stock["baseline"]) == ("ok", "false", "true")
    assert children["fast"]["status"] == "FINISHED"


def test_audio_artifacts_are_capped_by_save_audio(logged: dict[str, Any]) -> None:
    child = logged["data"]["children"]["fast"]
    assert logged["result"].job.workload.save_audio == 2
    assert child["artifacts"] == ["audio/p0_42.wav", "audio/p1_42.wav"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{logged['root'] / 'mlflow.db'}")
        local = tracking.client().download_artifacts(
            child["run_id"], "audio/p1_42.wav", str(logged["root"] / "dl")
        )
    assert Path(local).read_bytes() == (logged["root"] / "audio/fast/p1_42.wav").read_bytes()


def test_stack_ids_link_into_the_store(
    logged: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{logged['root'] / 'mlflow.db'}")
    ids = tracking.stack_run_ids(logged["parent"])
    assert ids == {name: c["run_id"] for name, c in logged["data"]["children"].items()}
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        run_id = store.ingest(logged["result"])
        store.set_mlflow_run_ids(run_id, logged["parent"], ids)
        run = store.get_run(run_id)
    assert run["mlflow_run_id"] == logged["parent"]
    assert [s["mlflow_run_id"] for s in run["stacks"]] == [ids["stock"], ids["fast"]]


@pytest.mark.slow  # creates a second MLflow database (its migrations take seconds)
def test_default_store_is_sqlite_in_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_result_record: MakeResult
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = make_result_record()  # its WAVs do not exist: logged without audio, no error
    parent = tracking.log_run(result, RUN_ID, result_path=tmp_path / "missing.json")
    assert (tmp_path / "mlflow.db").is_file()
    data = tracking.read_back(parent)
    assert data["artifacts"] == [] and data["children"]["stock"]["artifacts"] == []
    assert data["children"]["stock"]["metrics"]["rtf"] == 0.0812345678901


def test_failed_logging_marks_runs_failed(
    logged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{logged['root'] / 'mlflow.db'}")
    monkeypatch.chdir(logged["root"])

    def broken(*_: object, **__: object) -> None:
        raise OSError("artifact store unavailable")

    monkeypatch.setattr(tracking.MlflowClient, "log_artifact", broken)
    result = logged["result"]
    with pytest.raises(OSError, match="artifact store unavailable"):
        tracking.log_run(result, "f" * 32, result_path=logged["root"] / "result.json")
    mlf = tracking.client()
    experiment = mlf.get_experiment_by_name(tracking.experiment_name(result))
    [run] = mlf.search_runs([experiment.experiment_id], "tags.run_id = '" + "f" * 32 + "'")
    assert run.info.status == "FAILED"


def test_experiments_open_in_the_model_training_view(
    logged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow 3 shows an experiment without `mlflow.experimentKind` as a GenAI one."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{logged['root'] / 'mlflow.db'}")
    monkeypatch.chdir(logged["root"])
    mlf = tracking.client()
    made = mlf.get_experiment(logged["data"]["experiment_id"])
    assert made.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    # one made before the kind was set (by an older orchestrate) gets it when next logged to
    older = mlf.create_experiment("orchestrate/older/smoke")
    assert tracking.EXPERIMENT_KIND_TAG not in mlf.get_experiment(older).tags
    assert tracking._experiment_id(mlf, "orchestrate/older/smoke") == older
    kind = mlf.get_experiment(older).tags[tracking.EXPERIMENT_KIND_TAG]
    assert kind == "custom_model_development"
