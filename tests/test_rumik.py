"""Rumik family: stock loop behaviour, and what each technique changes (teacher-forced)."""

from __future__ import annotations

import pytest
import torch

from orchestrate.api.config import SamplingConfig, StackSpec, TechniqueRef
from orchestrate.api.registry import build_stack, discover, get, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.families.rumik import fidelity
from orchestrate.families.rumik.engine import stock_engine
from orchestrate.families.rumik.vocab import build_prompt
from orchestrate.techniques.rumik.static_kv_cache import CapacityError

FAMILY = get_family("rumik")

# Teacher forcing exercises the slots on the logits' path; samplers and loops are judged by
# distribution and token tests of their own (tests/test_gpu.py, tests/test_kernels.py).
TEACHER_FORCED_SLOTS = {"decoder", "decoder_class", "projections", "attention", "head"}


def with_prerequisites(name: str) -> list[str]:
    """`name` preceded by every technique it must follow (its `after`, recursively)."""
    out: list[str] = []
    for before in get(name).after:
        out += [n for n in with_prerequisites(before) if n not in out]
    return [*out, name]


def exact_stacks() -> list[list[str]]:
    """Every installed Rumik technique declared exact that runs on a CPU and touches the
    logits' path, alone (with its prerequisites) and all of them together: derived from the
    registry, so a new exact technique is tested without editing this list."""
    cpu = DeviceCaps("cpu")
    names = [
        n for n, cls in sorted(discover().items())
        if cls.family == "rumik" and cls.exact
        and not any(cpu.missing(r) for r in cls.requires)
        and TEACHER_FORCED_SLOTS & {*cls.slots, *cls.wraps}
    ]  # fmt: skip
    stacks = [with_prerequisites(n) for n in names]
    together: list[str] = []
    for stack in stacks:
        together += [n for n in stack if n not in together]
    return [*stacks, together] if len(stacks) > 1 else stacks


EXACT_STACKS = exact_stacks()


def test_the_exact_stacks_cover_the_cpu_exact_techniques():
    # The derivation must find the built-ins we know are exact on a CPU (a guard against a
    # filter that silently selects nothing).
    covered = {n for stack in EXACT_STACKS for n in stack}
    assert {"static_kv_cache", "packed_projections", "audio_head"} <= covered
    assert "codebook_head" not in covered  # declared approximate


def engine_for(model, names, **params):
    spec = StackSpec(
        name="t", techniques=[TechniqueRef(name=n, params=params.get(n, {})) for n in names]
    )
    return FAMILY.build_engine(model, build_stack(spec))


@pytest.fixture(scope="module")
def sequence(tiny_model):
    """A prompt and 96 tokens sampled by stock: long enough to cross the tiny sliding window."""
    prompt = tiny_model.encode_prompt(build_prompt("A short test sentence.", "Ira", "neutral"))
    gen = torch.Generator().manual_seed(7)
    eng = stock_engine(tiny_model)
    with torch.inference_mode():
        tokens = eng.loop(eng, prompt, 12, SamplingConfig(), gen).tokens
    assert len(prompt) + len(tokens) > tiny_model.config.sliding_window
    return prompt, tokens


@pytest.fixture(scope="module")
def stock_logits(tiny_model, sequence):
    return fidelity.teacher_forced(stock_engine(tiny_model), *sequence)


@pytest.fixture(scope="module")
def model_logits(tiny_model, sequence):
    """The same steps from one full-sequence forward of the transformers model: no engine,
    no cache, no teacher-forcing harness; in fidelity's canonical columns."""
    prompt, tokens = sequence
    vocab = tiny_model.vocab
    with torch.inference_mode():
        logits = tiny_model.lm(input_ids=torch.tensor([[*prompt, *tokens]])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]  # row i predicts tokens[i]
    units = rows[:, vocab.first_unit_id : vocab.last_unit_id + 1]
    return torch.cat([units, rows[:, vocab.end_id : vocab.end_id + 1]], -1)


def test_stock_reference_is_the_models_own_forward(stock_logits, model_logits):
    # What every exact stack is held to is not the harness measured against itself.
    assert stock_logits.shape == model_logits.shape
    assert float((stock_logits - model_logits).abs().max()) < 1e-4


@pytest.mark.parametrize("names", EXACT_STACKS, ids="+".join)
def test_exact_techniques_match_stock(tiny_model, sequence, stock_logits, names):
    eng = engine_for(tiny_model, names)
    assert all(
        t.exact
        for t in build_stack(
            StackSpec(name="t", techniques=[TechniqueRef(name=n) for n in names])
        ).techniques
    )
    other = fidelity.teacher_forced(eng, *sequence)
    rec = fidelity.compare(stock_logits, other, 0.8, 30, torch.float32)
    assert rec.within_tolerance, rec
    assert rec.max_abs_logit_diff < 1e-4
    assert rec.top1_agreement == 1.0


def test_codebook_head_is_flagged_and_measurably_approximate(
    tiny_model, sequence, stock_logits, model_logits
):
    spec = StackSpec(name="t", techniques=[TechniqueRef(name="codebook_head")])
    assert build_stack(spec).exact is False
    other = fidelity.teacher_forced(engine_for(tiny_model, ["codebook_head"]), *sequence)
    rec = fidelity.compare(stock_logits, other, 0.8, 30, torch.float32)
    assert not rec.within_tolerance
    assert rec.mean_kl > 0.1  # it moves the distribution: only 1/8 of the units remain
    # ...but on the columns it keeps, the logits are stock's own.
    keep = torch.isfinite(other)
    assert torch.allclose(other[keep], stock_logits[keep], atol=1e-5)
    # so the support-restricted view sees nothing else changed: the KL is the restriction
    assert rec.support_kl is not None and rec.support_kl < 1e-6 and rec.support_top1 == 1.0
    # a full-vocabulary stack (stock, against the model's own forward): the support view is
    # the whole view, and there is nothing to see
    full = fidelity.compare(model_logits, stock_logits, 0.8, 30, torch.float32)
    assert full.support_kl == full.mean_kl < 1e-6 and full.support_top1 == 1.0
    # every step only offers codebook step % 8 (and end-of-audio)
    vocab = tiny_model.vocab
    for step in range(16):
        cols = torch.nonzero(keep[step]).flatten()[:-1]
        assert set((cols % vocab.num_quantizers).tolist()) == {step % vocab.num_quantizers}


def test_fixed_length_policy_gives_equal_lengths_and_same_tokens(tiny_model):
    """Exact stacks sample the very same tokens as stock from the same seed."""
    prompt = tiny_model.encode_prompt(build_prompt("Hello.", "Ira", None))
    outs = []
    for names in ([], ["static_kv_cache", "packed_projections", "audio_head"]):
        eng = engine_for(tiny_model, names)
        with torch.inference_mode():
            gen = eng.loop(eng, prompt, 5, SamplingConfig(), torch.Generator().manual_seed(3))
        assert gen.stop_reason == "length_policy" and len(gen.tokens) == 40
        assert tiny_model.vocab.end_id not in gen.tokens
        outs.append(gen.tokens)
    assert outs[0] == outs[1]


def test_model_length_policy_obeys_stop_head(tiny_model, monkeypatch):
    eng = stock_engine(tiny_model)
    calls = []

    def fires(hidden):
        calls.append(1)
        return torch.ones(1, 1)

    monkeypatch.setattr(eng, "stop_probability", fires)
    prompt = tiny_model.encode_prompt(build_prompt("Hi.", "Ira", None))
    with torch.inference_mode():
        gen = eng.loop(eng, prompt, None, SamplingConfig(), torch.Generator().manual_seed(0))
    # not consulted before 8 tokens, then it forces end-of-audio at once
    assert gen.stop_reason == "stop_head" and len(gen.tokens) == 8 and len(calls) == 1


def test_token_cap(tiny_model):
    eng = stock_engine(tiny_model)
    prompt = tiny_model.encode_prompt(build_prompt("Hi.", "Ira", None))
    sampling = SamplingConfig(max_new_tokens=16, min_tokens_before_stop=100)
    with torch.inference_mode():
        gen = eng.loop(eng, prompt, None, sampling, torch.Generator().manual_seed(0))
    assert gen.stop_reason == "token_cap" and len(gen.tokens) == 16


def test_static_cache_capacity_error_names_the_limit(tiny_model):
    eng = engine_for(tiny_model, ["static_kv_cache"], static_kv_cache={"max_seq_len": 32})
    prompt = tiny_model.encode_prompt(build_prompt("Hello there.", "Ira", None))
    with (
        pytest.raises(CapacityError, match="static_kv_cache.max_seq_len is 32"),
        torch.inference_mode(),
    ):
        eng.loop(eng, prompt, 10, SamplingConfig(), torch.Generator().manual_seed(0))


def test_token_assembly(tiny_model):
    vocab = tiny_model.vocab
    first, q = vocab.first_unit_id, vocab.num_quantizers
    frame = [first + q * code + i for i, code in enumerate([5, 6, 7, 8, 9, 10, 11, 12])]
    bad = [first + 3]  # codebook 3 where codebook 0 is due: resync drops it
    codes = vocab.tokens_to_codes(frame + bad + frame + [vocab.end_id] + frame)
    assert codes.shape == (1, 8, 2)
    assert codes[0, :, 0].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    pos = vocab.positional_codes(bad + frame[1:])  # 8 tokens, codebooks ignored
    assert pos.shape == (1, 8, 1) and pos[0, 1:, 0].tolist() == [6, 7, 8, 9, 10, 11, 12]


def test_synthesize_times_whole_clip(tiny_model):
    from orchestrate.api.config import LengthPolicy, Prompt, Workload

    wl = Workload(
        name="w",
        prompts=[Prompt(id="a", text="Hi.")],
        warmups=0,
        length_policy=LengthPolicy(mode="fixed", frames=3),
    )
    syn = FAMILY.synthesize(stock_engine(tiny_model), "Hi.", 1, wl)
    assert syn.frames == 3 and syn.new_tokens == 24
    assert syn.audio.shape == (3 * 1920,) and syn.sample_rate == 24_000
    assert syn.latency_s >= syn.lm_s + syn.codec_s - 1e-6 and syn.codec_s > 0
    assert 0 < syn.prefill_s < syn.lm_s  # prefill is timed inside the token loop
    with pytest.raises(ValueError, match="unknown voice 'Bob'"):
        FAMILY.synthesize(
            stock_engine(tiny_model), "Hi.", 1, wl.model_copy(update={"voice": "Bob"})
        )


def test_step_bytes_at_real_shape_match_the_counted_floor():
    """On the meta device (no memory): 3,381,533,697 parameters; one bf16 step with the
    full head at ~1,124 positions reads 6.85 GB, as counted by hand in the project notes."""
    from transformers import Cohere2ForCausalLM

    from orchestrate.families.rumik.model import RumikModel, StopHead, _lm_config
    from orchestrate.families.rumik.presets import RUMIK_OSS_1 as P
    from orchestrate.families.rumik.vocab import ByteTokenizer

    with torch.device("meta"):
        lm = Cohere2ForCausalLM(_lm_config(P)).to(torch.bfloat16)
        stop = StopHead(2048, P.stop_hidden).to(torch.bfloat16)
    model = RumikModel(lm, stop, None, P.vocab, ByteTokenizer(P.vocab), P.voices, P.name, True)
    n_params = sum(p.numel() for p in (*lm.parameters(), *stop.parameters()))
    assert n_params == 3_381_533_697
    full = FAMILY.step_bytes(stock_engine(model), 1124)
    assert full == pytest.approx(6.846e9, rel=1e-3)
    audio = FAMILY.build_engine(
        model, build_stack(StackSpec(name="a", techniques=[TechniqueRef(name="audio_head")]))
    )
    # the head shrinks from 277,404 to 16,385 rows of 2,048 bf16 values
    assert full - FAMILY.step_bytes(audio, 1124) == (277_404 - 16_385) * 2048 * 2


@pytest.mark.slow
def test_compiled_static_decoder_is_exact_on_cpu(tiny_model, sequence, stock_logits):
    """torch.compile of the decode step (inductor on the CPU) computes stock's logits."""
    eng = engine_for(tiny_model, ["static_kv_cache"], static_kv_cache={"compile": True})
    other = fidelity.teacher_forced(eng, *sequence)
    rec = fidelity.compare(stock_logits, other, 0.8, 30, torch.float32)
    assert rec.within_tolerance, rec


def test_baseline_b_generates_audio_units_only(tiny_model):
    """transformers generate() with a static cache, restricted to the audio vocabulary."""
    eng = engine_for(tiny_model, ["hf_generate_static"])
    prompt = tiny_model.encode_prompt(build_prompt("Baseline B.", "Ira", None))
    with torch.inference_mode():
        gen = eng.loop(eng, prompt, 3, SamplingConfig(), torch.Generator().manual_seed(4))
        again = eng.loop(eng, prompt, 3, SamplingConfig(), torch.Generator().manual_seed(4))
    vocab = tiny_model.vocab
    assert gen.stop_reason == "length_policy" and len(gen.tokens) == 24
    assert all(vocab.first_unit_id <= t <= vocab.last_unit_id for t in gen.tokens)
    assert gen.tokens == again.tokens  # seeded through the global RNG it draws from
