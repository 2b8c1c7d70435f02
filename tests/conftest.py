"""Shared pytest fixtures. Record factories live in factories.py (one place for all tests)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
from factories import MakeResult, fabricate_result

from orchestrate.api.config import ModelSpec

# OmniVoice: family, model, engine_for; pg_server: a PostgreSQL server and `db_url`, the
# store tests' parameter (SQLite and PostgreSQL).
pytest_plugins = ["omnivoice_fixtures", "pg_server"]

# CI sets it: a missing or broken optional install fails instead of skipping.
REQUIRE = os.environ.get("ORCHESTRATE_REQUIRE_QUALITY") == "1"


def require_or_skip(
    pkg: str, *, gpu: bool = False, exc_type: type[BaseException] = ImportError
) -> ModuleType:
    """Import `pkg`, or skip saying why (also at module level). Under
    ORCHESTRATE_REQUIRE_QUALITY=1, or for a GPU-only package (`gpu`) on a CUDA host, a failed
    import fails instead: a broken install must never pass as a skip."""
    try:
        return importlib.import_module(pkg)
    except exc_type as exc:
        why = f"{pkg} cannot be imported ({type(exc).__name__}: {exc})"
        if REQUIRE or (gpu and _cuda()):
            pytest.fail(f"{why}; required here (ORCHESTRATE_REQUIRE_QUALITY=1 or CUDA)")
        pytest.skip(why, allow_module_level=True)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------ store/tracking tests: fabricated result records


@pytest.fixture(scope="session")
def make_result_record() -> MakeResult:
    """Factory for fabricated ResultRecords (see fabricate_result for its arguments)."""
    return fabricate_result


# ------------------------------------------------ model tests: one tiny Rumik per session


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny preset (real architecture, random weights), built once per test session."""
    from orchestrate.families.rumik.model import build_model

    return build_model(ModelSpec(preset="tiny"))


# The files whose tests took longest in CI's parallel pass (seconds, summed over its 60
# slowest tests, 2-core VM, at a80e9b3), heaviest first. pytest-xdist hands out files in
# collection order, so a heavy file collected late (test_resume.py, alphabetically) kept one
# core busy alone for about six minutes at the end of the pass: longest first, the two
# workers finish close together. Order only: a file missing here runs after these, as before.
HEAVIEST_FIRST = (
    "test_kernels.py",  # 513: the Triton interpreter in a subprocess
    "test_faults_inject.py",  # 411
    "test_end_to_end.py",  # 386
    "test_faults_storage.py",  # 336
    "test_warm_worker.py",  # 315
    "test_reports.py",  # 287
    "test_piper.py",  # 258
    "test_resume.py",  # 253
    "test_queue.py",  # 204
    "test_explore.py",  # 197
    "test_bad_input.py",  # 115 (and many tests under 20 s)
    "test_exactness.py",  # 115
    "test_omnivoice.py",  # 106
    "test_plugins.py",  # 105
    "test_mlflow_server.py",  # 87
    "test_holdout_seal.py",  # 79
)


def pytest_collection_modifyitems(config, items):
    """Heaviest files first (HEAVIEST_FIRST; a stable sort keeps each file's own order), and
    `gpu` tests skip with a reason where CUDA is absent: they run on the device machine."""
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
