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


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run on the device machine; where CUDA is absent they skip with a reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
