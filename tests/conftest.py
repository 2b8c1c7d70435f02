"""Shared pytest fixtures. Record factories live in factories.py (one place for all tests)."""

from __future__ import annotations

import pytest
from factories import MakeResult, fabricate_result

from orchestrate.api.config import ModelSpec

pytest_plugins = ["omnivoice_fixtures"]  # family, model, engine_for of the OmniVoice tests

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
