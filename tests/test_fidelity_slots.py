"""Fidelity measures the sampler and loop slots too, so `exact` there is not a plugin's word.

Third-party techniques defined here (a greedy sampler and a stale-token loop declared exact,
honest re-implementations of stock's sampler and loop) are installed in the catalogue and
judged through the worker's path (guards.fidelity_per_stack -> RumikFamily.fidelity) on the
tiny model on a CPU: the liars fail tolerance, the honest ones pass, and each record's
`covers` says what ran. GPU tests hold device_sampler and graph_loop to the same checks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from orchestrate.api import registry
from orchestrate.api.config import (
    LengthPolicy,
    ModelSpec,
    Prompt,
    SamplingConfig,
    StackSpec,
    TechniqueRef,
    Workload,
)
from orchestrate.api.records import FidelityRecord
from orchestrate.api.registry import build_stack, get_family
from orchestrate.api.technique import DeviceCaps, Technique
from orchestrate.families.rumik import fidelity
from orchestrate.families.rumik.engine import (
    Engine,
    Generation,
    HeadLogits,
    host_loop,
    stock_engine,
    token_budget,
)
from orchestrate.families.rumik.model import RumikModel
from orchestrate.families.rumik.vocab import build_prompt
from orchestrate.running.guards import fidelity_per_stack

FAMILY = get_family("rumik")
STEPS = 16  # two frames: what the loop test generates
WORKLOAD = Workload(
    name="slots",
    prompts=[Prompt(id="a", text="A short test sentence.")],
    seeds=[42],
    delivery="neutral",
    length_policy=LengthPolicy(mode="fixed", frames=2),
)


# ------------------------------------------------------------- third-party test parts


def _allowed(head: HeadLogits, allow_end: bool, force_end: bool) -> torch.Tensor:
    """The columns stock's sampler may draw from, as a row of logits (-inf elsewhere)."""
    keep = torch.zeros_like(head.logits[0], dtype=torch.bool)
    if force_end:
        keep[head.end_column] = True
    else:
        keep[head.unit_columns] = True
        keep[head.end_column] = allow_end
    return head.logits[0].masked_fill(~keep, float("-inf"))


def _to_id(head: HeadLogits, col: torch.Tensor) -> torch.Tensor:
    return (col if head.column_ids is None else head.column_ids[col]).view(1, 1)


def greedy_sampler(
    head: HeadLogits,
    *,
    allow_end: bool,
    force_end: bool,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> torch.Tensor:
    """Always the most likely allowed column: same argmax as stock, not its distribution."""
    return _to_id(head, _allowed(head, allow_end, force_end).argmax())


def inverse_cdf_sampler(
    head: HeadLogits,
    *,
    allow_end: bool,
    force_end: bool,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> torch.Tensor:
    """Stock's distribution (temperature, top-k) by another route, one uniform per token:
    another random stream, so only a distribution test can tell it is honest."""
    vals, idx = (_allowed(head, allow_end, force_end) / sampling.temperature).topk(sampling.top_k)
    cdf = vals.softmax(-1).cumsum(-1)
    u = torch.rand(1, generator=generator, device=cdf.device)
    return _to_id(head, idx[torch.searchsorted(cdf, u).clamp_max(len(cdf) - 1)])


def unforced_sampler(
    head: HeadLogits,
    *,
    allow_end: bool,
    force_end: bool,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> torch.Tensor:
    """Stock's distribution, except that force_end only allows the end token (the model's
    stop decision is not obeyed): right on every row but one."""
    return inverse_cdf_sampler(
        head,
        allow_end=allow_end or force_end,
        force_end=False,
        sampling=sampling,
        generator=generator,
    )


def own_loop(
    engine: Engine,
    prompt_ids: list[int],
    frames: int | None,
    sampling: SamplingConfig,
    generator: torch.Generator,
    *,
    stale_at: int | None = None,
    reseed: bool = False,
) -> Generation:
    """stock's loop rewritten for a length policy (what fidelity runs). `stale_at` feeds the
    previous token at that step (an off-by-one); `reseed` draws from another stream."""
    if frames is None:
        return host_loop(engine, prompt_ids, frames, sampling, generator)
    device = engine.model.device
    if reseed:
        generator = torch.Generator(device=device).manual_seed(generator.initial_seed() + 1)
    if reset := getattr(engine.sampler, "reset", None):
        reset(generator.initial_seed())
    cap = token_budget(sampling, frames, engine.model.vocab.num_quantizers)
    decoder = engine.new_decoder(len(prompt_ids) + cap + 1)
    hidden = decoder.prefill(torch.tensor([prompt_ids], device=device))
    tokens: list[int] = []
    for step in range(cap):
        token = engine.sampler(
            engine.head(hidden, step),
            allow_end=False,
            force_end=False,
            sampling=sampling,
            generator=generator,
        )
        fed = tokens[-1] if step == stale_at else int(token)
        tokens.append(int(token))
        if step + 1 < cap:
            hidden = decoder.step(torch.tensor([[fed]], device=device))
    return Generation(tokens, "length_policy")


def _technique(name: str, slot: str, part: object) -> type[Technique]:
    """A technique declared exact that puts `part` in `slot`, as a plugin would."""

    def apply(self: Technique, engine: Engine) -> None:
        setattr(engine, slot, part)

    attrs = {"name": name, "family": "rumik", "exact": True, "slots": (slot,), "apply": apply}
    return type(name, (Technique,), attrs)


LoopFn = Callable[..., Generation]


def _loop(**kw: object) -> LoopFn:
    return lambda *args: own_loop(*args, **kw)


PLUGINS = {
    "greedy_sampler": _technique("greedy_sampler", "sampler", greedy_sampler),
    "honest_sampler": _technique("honest_sampler", "sampler", inverse_cdf_sampler),
    "unforced_sampler": _technique("unforced_sampler", "sampler", unforced_sampler),
    "honest_loop": _technique("honest_loop", "loop", _loop()),
    "stale_loop": _technique("stale_loop", "loop", _loop(stale_at=3)),
    "reseeded_loop": _technique("reseeded_loop", "loop", _loop(reseed=True)),
}
STACKS = {
    "stock": [],
    "audio_head": ["audio_head"],  # teacher-forced slots only
    "greedy": ["greedy_sampler"],
    "honest_sampler": ["honest_sampler"],
    "unforced": ["unforced_sampler"],
    "honest_loop": ["honest_loop"],
    "stale_loop": ["stale_loop"],
    "reseeded_loop": ["reseeded_loop"],
    "honest_both": ["static_kv_cache", "honest_sampler", "honest_loop"],
    "baseline_b": ["hf_generate_static"],  # generate(): its own sampler and RNG in the loop
}


def build(model: RumikModel, names: list[str], caps: DeviceCaps | None = None) -> Engine:
    spec = StackSpec(name="t", techniques=[TechniqueRef(name=n) for n in names])
    return FAMILY.build_engine(model, build_stack(spec, caps, strict=caps is not None))


@pytest.fixture(scope="module")
def records(tiny_model: RumikModel) -> dict[str, FidelityRecord]:
    """Every stack judged in one call, as the worker judges a run's stacks."""
    cat = registry.catalogue()
    fake = registry.Catalogue(cat.families, {**cat.techniques, **PLUGINS}, cat.broken)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "catalogue", lambda: fake)  # as if pip-installed
        engines = {name: build(tiny_model, names) for name, names in STACKS.items()}
    found, errors = fidelity_per_stack(FAMILY, tiny_model, engines, WORKLOAD, STEPS, repr)
    assert not errors, errors
    return found


# ------------------------------------------------------------------------------ tests


def test_bound_comes_from_sampling_error() -> None:
    # Two samples of one distribution: the bound holds them; it shrinks as draws grow.
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(30, generator=gen), -1)
    a, b = (torch.multinomial(p, 2000, True, generator=gen) for _ in range(2))
    bound = fidelity.tv_bound(2000, 30, 5)
    assert fidelity.total_variation(a, b) < bound < 0.2
    assert fidelity.tv_bound(8000, 30, 5) < bound / 1.9
    assert fidelity.total_variation(a, a) == 0 and fidelity.total_variation(a, a + 30) == 1


@pytest.mark.parametrize("name", ["greedy", "unforced"])
def test_lying_sampler_declared_exact_is_caught(
    records: dict[str, FidelityRecord], name: str
) -> None:
    rec = records[name]
    assert rec.max_abs_logit_diff == 0  # teacher forcing alone sees nothing wrong
    assert rec.sampler_tv is not None and rec.sampler_tv_bound is not None
    assert rec.sampler_tv > rec.sampler_tv_bound and not rec.within_tolerance
    assert rec.sampler_draws == fidelity.SAMPLER_DRAWS


def test_honest_sampler_on_another_stream_passes(records: dict[str, FidelityRecord]) -> None:
    rec = records["honest_sampler"]
    assert rec.sampler_tv is not None and rec.sampler_tv_bound is not None
    assert 0 < rec.sampler_tv <= rec.sampler_tv_bound  # other draws, same distribution
    assert rec.within_tolerance


@pytest.mark.parametrize("name", ["stale_loop", "reseeded_loop"])
def test_lying_loop_declared_exact_is_caught(records: dict[str, FidelityRecord], name: str) -> None:
    rec = records[name]
    assert rec.max_abs_logit_diff == 0 and rec.loop_tokens_identical is False
    assert rec.loop_first_divergence is not None and rec.loop_note
    assert not rec.within_tolerance
    if name == "stale_loop":  # the fed token is wrong at step 3: step 4 is the first it moves
        assert rec.loop_first_divergence >= 4


def test_honest_loop_passes(records: dict[str, FidelityRecord]) -> None:
    for name in ("honest_loop", "honest_both"):
        rec = records[name]
        assert rec.loop_tokens_identical and rec.loop_first_divergence is None, rec
        assert rec.within_tolerance, rec
    both = records["honest_both"]
    assert both.sampler_tv is not None and both.sampler_tv_bound is not None
    assert both.sampler_tv <= both.sampler_tv_bound


def test_covers_say_what_ran(records: dict[str, FidelityRecord]) -> None:
    taught = list(fidelity.COVERS)
    for name in ("stock", "audio_head"):  # nothing filled the sampler or loop: not tested
        rec = records[name]
        assert rec.covers == taught and rec.not_covered == {}
        assert rec.sampler_tv is None and rec.loop_tokens_identical is None
    assert records["greedy"].covers == [*taught, "sampler"]
    assert records["greedy"].loop_tokens_identical is None  # stock's loop: nothing to test
    assert records["honest_loop"].covers == [*taught, "loop"]
    assert records["honest_loop"].sampler_tv is None
    both = records["honest_both"]
    assert both.covers == [*taught, "sampler", "loop"] and both.not_covered == {}


def test_baseline_b_no_longer_reads_within_tolerance(records: dict[str, FidelityRecord]) -> None:
    # Teacher forcing never ran generate(): B's "KL 0" said nothing. Its loop test runs it.
    rec = records["baseline_b"]
    assert rec.max_abs_logit_diff == 0 and "loop" in rec.covers
    assert rec.loop_tokens_identical is False and not rec.within_tolerance


def test_show_prints_each_slot_test(records: dict[str, FidelityRecord]) -> None:
    from orchestrate.reports.tables import slot_checks_line

    greedy = slot_checks_line("greedy", records["greedy"].model_dump())
    assert greedy and "NOT the same distribution" in greedy and "vs bound" in greedy
    honest = slot_checks_line("h", records["honest_both"].model_dump())
    assert honest and "same distribution" in honest and "NOT" not in honest
    assert "tokens identical to host_loop" in honest
    assert slot_checks_line("stock", records["stock"].model_dump()) is None


def test_the_verdict_names_the_part_that_failed(records: dict[str, FidelityRecord]) -> None:
    """The printed figures are the logits'; an OUTSIDE verdict says which part put it there
    (baseline B printed 'OUTSIDE tolerance; mean KL 0, top-1 1.000' with no reason)."""
    from orchestrate.reports.tables import fidelity_verdict

    def verdict(name: str) -> str:
        return fidelity_verdict(records[name].model_dump())

    assert verdict("baseline_b") == "OUTSIDE tolerance (loop tokens)"
    assert verdict("greedy") == "OUTSIDE tolerance (sampler)"
    assert verdict("stale_loop") == "OUTSIDE tolerance (loop tokens)"
    assert verdict("honest_both") == verdict("stock") == "within tolerance"
    assert records["baseline_b"].logits_within_tolerance is True
    moved = records["greedy"].model_copy(update={"logits_within_tolerance": False})
    assert fidelity_verdict(moved.model_dump()) == "OUTSIDE tolerance (logits, sampler)"
    older = {"within_tolerance": False}  # a record from before the slot tests: the logits
    assert fidelity_verdict(older) == "OUTSIDE tolerance (logits)"


def test_without_sampling_settings_the_slots_stay_not_covered(tiny_model: RumikModel) -> None:
    # Reference.judge alone (no sampling settings) is teacher forcing only, and says so.
    cat = registry.catalogue()
    fake = registry.Catalogue(cat.families, {**cat.techniques, **PLUGINS}, cat.broken)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "catalogue", lambda: fake)
        eng = build(tiny_model, ["greedy_sampler", "honest_loop"])
    prompt = tiny_model.encode_prompt(build_prompt("A sentence.", "Ira", None))
    stock = stock_engine(tiny_model)
    with torch.inference_mode():
        tokens = stock.loop(stock, prompt, 1, SamplingConfig(), torch.Generator().manual_seed(1))
    ref = fidelity.Reference.build(tiny_model, prompt, tokens.tokens, 0.8, 30)
    rec = ref.judge(eng)
    assert rec.within_tolerance and rec.sampler_tv is None
    assert rec.not_covered == {"sampler": "greedy_sampler", "loop": "honest_loop"}


# ------------------------------------------------------------------ on the device machine

GPU_STACKS = {
    "tiny-device-sampler": ("tiny", "float32", ["static_kv_cache", "device_sampler"]),
    "tiny-graph-loop": (
        "tiny",
        "float32",
        ["static_kv_cache", "codebook_head", "device_sampler", "graph_loop"],
    ),
    "exp74": (
        "small-128",
        "bfloat16",
        [
            "static_kv_cache",
            "int8_projections",
            "decode_attention",
            "codebook_head",
            "device_sampler",
            "graph_loop",
        ],
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_STACKS))
def test_device_sampler_and_graph_loop_pass_the_slot_checks(name: str) -> None:
    """device_sampler draws stock's distribution (other stream: TV within the bound); graph_loop
    gives host_loop's tokens over the same parts (one device stream, reset per utterance)."""
    preset, dtype, names = GPU_STACKS[name]
    model = FAMILY.build_model(ModelSpec(preset=preset, device="cuda", dtype=dtype))
    eng = build(model, names, DeviceCaps.probe("cuda"))
    rec = FAMILY.fidelity(model, {name: eng}, WORKLOAD, STEPS)[name]
    assert rec.sampler_tv is not None and rec.sampler_tv_bound is not None
    assert rec.sampler_tv <= rec.sampler_tv_bound, rec
    assert "sampler" in (rec.covers or []) and "sampler" not in rec.not_covered
    if "graph_loop" in names:
        assert rec.loop_tokens_identical, rec
        assert "loop" in (rec.covers or []) and rec.not_covered == {}
