"""Real weights load from a local save_pretrained folder; missing weights fail clearly."""

from __future__ import annotations

import pytest
import torch

from orchestrate.api.config import ModelSpec, SamplingConfig
from orchestrate.families.rumik.engine import stock_engine
from orchestrate.families.rumik.model import WeightsError, build_model, save_pretrained
from orchestrate.families.rumik.vocab import build_prompt


def test_save_then_load_gives_the_same_model(tiny_model, tmp_path):
    folder = save_pretrained(tiny_model, tmp_path / "ckpt")
    loaded = build_model(ModelSpec(weights=str(folder)))
    assert loaded.random_weights is False
    assert loaded.vocab == tiny_model.vocab
    for a, b in zip(
        tiny_model.lm.state_dict().values(), loaded.lm.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)
    for a, b in zip(
        tiny_model.stop_head.state_dict().values(),
        loaded.stop_head.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b)
    prompt = tiny_model.encode_prompt(build_prompt("Same weights, same tokens.", "Ira", None))
    tokens = []
    for model in (tiny_model, loaded):
        eng = stock_engine(model)
        with torch.inference_mode():
            tokens.append(
                eng.loop(eng, prompt, 4, SamplingConfig(), torch.Generator().manual_seed(5)).tokens
            )
    assert tokens[0] == tokens[1]


def test_missing_weights_are_a_clear_error(tmp_path):
    with pytest.raises(WeightsError, match="neither a local folder nor in the HF cache"):
        build_model(ModelSpec(weights="no-such-org/no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no config.json"):
        build_model(ModelSpec(weights=str(tmp_path / "empty")))


def test_checkpoint_without_stop_head_is_refused(tiny_model, tmp_path):
    folder = save_pretrained(tiny_model, tmp_path / "ckpt")
    (folder / "stop_head.safetensors").unlink()
    with pytest.raises(WeightsError, match="stop_predictor"):
        build_model(ModelSpec(weights=str(folder)))


def test_cuda_on_a_cpu_machine_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        build_model(ModelSpec(device="cuda"))
