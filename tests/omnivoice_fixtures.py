"""OmniVoice test fixtures, loaded for every module by conftest's `pytest_plugins`: one
temporary model cache for the session, the family, its tiny random-weight model, and
`engine_for` (an engine from technique refs, CPU unless told)."""

from __future__ import annotations

import os

import pytest

from orchestrate.api.config import ModelSpec, StackSpec, TechniqueRef
from orchestrate.api.registry import build_stack, get_family
from orchestrate.api.technique import DeviceCaps


@pytest.fixture(scope="session", autouse=True)
def _omnivoice_cache(tmp_path_factory):  # random weights are saved once, not in ~/.cache
    os.environ.setdefault("ORCHESTRATE_CACHE", str(tmp_path_factory.mktemp("ovcache")))


@pytest.fixture(scope="module")
def family():
    return get_family("omnivoice")


@pytest.fixture(scope="module")
def model(family):
    return family.build_model(ModelSpec(family="omnivoice", preset="tiny"))


def engine_for(family, model, *techniques, caps=None):
    spec = StackSpec(
        name="s", family="omnivoice", techniques=[TechniqueRef(**t) for t in techniques]
    )
    return family.build_engine(model, build_stack(spec, caps or DeviceCaps("cpu")))
