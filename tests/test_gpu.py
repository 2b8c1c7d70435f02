"""What each technique changes, checked on the GPU (run on the device machine).

fp32 runs prove the math; bf16 runs use the production dtype and its wider tolerance.
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.config import ModelSpec, SamplingConfig, StackSpec, TechniqueRef
from orchestrator.families.rumik import FAMILY, fidelity
from orchestrator.families.rumik.engine import stock_engine
from orchestrator.families.rumik.vocab import build_prompt
from orchestrator.registry import build_stack
from orchestrator.technique import DeviceCaps

pytestmark = pytest.mark.gpu

STACKS = {
    "static": [("static_kv_cache", {})],
    "packed+audio": [("static_kv_cache", {}), ("packed_projections", {}), ("audio_head", {})],
    "compiled": [
        ("static_kv_cache", {"compile": True, "compile_mode": "reduce-overhead"}),
        ("packed_projections", {}),
        ("audio_head", {}),
    ],
}


def build(model, techniques):
    spec = StackSpec(name="t", techniques=[TechniqueRef(name=n, params=p) for n, p in techniques])
    built = build_stack(spec, DeviceCaps.probe("cuda"), strict=True)
    return FAMILY.build_engine(model, built)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def case(request):
    model = FAMILY.build_model(ModelSpec(preset="tiny", device="cuda", dtype=request.param))
    prompt = model.encode_prompt(build_prompt("A sentence for the GPU.", "Ira", "neutral"))
    eng = stock_engine(model)
    gen = torch.Generator(device="cuda").manual_seed(11)
    with torch.inference_mode():
        tokens = eng.loop(eng, prompt, 12, SamplingConfig(), gen).tokens
    ref = fidelity.teacher_forced(eng, prompt, tokens)
    return model, prompt, tokens, ref


@pytest.mark.parametrize("name", list(STACKS))
def test_exact_on_gpu(case, name):
    model, prompt, tokens, ref = case
    eng = build(model, STACKS[name])
    # twice: the second pass replays whatever the first compiled or captured
    for _ in range(2):
        other = fidelity.teacher_forced(eng, prompt, tokens)
        rec = fidelity.compare(ref, other, 0.8, 30, model.dtype)
        assert rec.within_tolerance, (name, model.dtype, rec)
        assert rec.top1_agreement >= 0.95, rec
