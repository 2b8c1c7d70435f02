"""Config loading: unknown keys, bad values and unknown names fail with a location."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrate.api.config import (
    ConfigError,
    LengthPolicy,
    load_model_spec,
    load_stack,
    load_workload,
)


def write(tmp_path: Path, text: str, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_configs_load():
    assert load_workload("smoke").sampling.top_k == 30
    en20 = load_workload("en20")
    assert len(en20.prompts) == 20 and en20.seeds == [42, 43, 44] and en20.warmups == 3
    frames = [en20.length_policy.frames_for(p.text) for p in en20.prompts]
    assert 78 <= sum(frames) / len(frames) <= 82  # ~6.4 s of audio per clip on average
    assert load_stack("stock").techniques == []
    assert load_model_spec("rumik-oss-1").dtype == "bfloat16"


def test_unknown_key_is_an_error(tmp_path):
    path = write(tmp_path, "name: s\nfamily: rumik\ntechnique: []\n")
    with pytest.raises(ConfigError, match="technique: Extra inputs are not permitted"):
        load_stack(str(path))


def test_bad_value_names_its_location(tmp_path):
    text = "name: w\nprompts: [{id: a, text: hi}]\nsampling: {temperature: -1}\n"
    with pytest.raises(ConfigError, match=r"sampling\.temperature"):
        load_workload(str(write(tmp_path, text)))


def test_duplicate_prompt_ids(tmp_path):
    text = "name: w\nprompts: [{id: a, text: hi}, {id: a, text: ho}]\n"
    with pytest.raises(ConfigError, match="duplicate prompt ids"):
        load_workload(str(write(tmp_path, text)))


def test_not_yaml_mapping(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_stack(str(write(tmp_path, "- just\n- a list\n")))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_stack(str(write(tmp_path, "name: [unclosed\n")))


def test_unknown_names_list_known_ones():
    with pytest.raises(ConfigError, match="unknown stack 'nope'.*stock"):
        load_stack("nope")
    with pytest.raises(ConfigError, match="unknown model 'nope'.*tiny"):
        load_model_spec("nope")
    with pytest.raises(ConfigError, match="device"):
        load_model_spec("tiny", device="tpu")


def test_length_policy_modes():
    assert LengthPolicy(mode="model").frames_for("hello") is None
    assert LengthPolicy(mode="fixed", frames=12).frames_for("anything") == 12
    policy = LengthPolicy(mode="per_char", frames_per_char=2.0, min_frames=3, max_frames=10)
    assert policy.frames_for("a") == 3 and policy.frames_for("abcd") == 8
    assert policy.frames_for("x" * 100) == 10


def test_repeated_technique_rejected(tmp_path):
    text = "name: s\ntechniques: [{name: audio_head}, {name: audio_head}]\n"
    with pytest.raises(ConfigError, match="more than once"):
        load_stack(str(write(tmp_path, text)))
