"""What each technique changes, checked on the GPU (run on the device machine).

fp32 runs prove the math; bf16 runs use the production dtype and its wider tolerance.
"""

from __future__ import annotations

import pytest
import torch

from orchestrate.api.config import ModelSpec, SamplingConfig, StackSpec, TechniqueRef
from orchestrate.api.registry import build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.families.rumik import fidelity
from orchestrate.families.rumik.engine import stock_engine
from orchestrate.families.rumik.vocab import build_prompt

FAMILY = get_family("rumik")

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


# exp74 and exp74-full without their loop technique (graph_loop / while_graph)
EXP74_BODY = [(name, {}) for name in (
    "static_kv_cache", "int8_projections", "decode_attention", "codebook_head", "device_sampler"
)]  # fmt: skip
EXP74_FULL_BODY = [*EXP74_BODY[:4], ("fused_rope_norm", {}), ("device_sampler", {})]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def case(request):
    model = FAMILY.build_model(ModelSpec(preset="tiny", device="cuda", dtype=request.param))
    prompt = model.encode_prompt(build_prompt("A sentence for the GPU.", "Ira", "neutral"))
    eng = stock_engine(model)
    gen = torch.Generator(device="cuda").manual_seed(11)
    with torch.inference_mode():
        tokens = eng.loop(eng, prompt, 12, SamplingConfig(), gen).tokens
    return model, prompt, fidelity.Reference.build(model, prompt, tokens, 0.8, 30)


@pytest.mark.parametrize("name", list(STACKS))
def test_exact_on_gpu(case, name):
    model, _, ref = case
    eng = build(model, STACKS[name])
    # twice: the second pass replays whatever the first compiled or captured
    for _ in range(2):
        rec = ref.judge(eng)
        assert rec.within_tolerance, (name, model.dtype, rec)
        assert rec.top1_agreement >= 0.95, rec


# ----------------------------------------------- the Triton / graph techniques (head_dim 128)

EXACT_128 = {
    "cuda_graph": [("static_kv_cache", {}), ("packed_projections", {}), ("cuda_graph", {})],
    "decode_attention": [("static_kv_cache", {}), ("decode_attention", {})],
    "exact-graph": [
        ("static_kv_cache", {}),
        ("packed_projections", {}),
        ("decode_attention", {}),
        ("audio_head", {}),
        ("cuda_graph", {}),
    ],
    "pdl": [("static_kv_cache", {}), ("decode_attention", {"pdl": True}), ("cuda_graph", {})],
    "fused_rope_norm": [("static_kv_cache", {}), ("fused_rope_norm", {})],
    "fused_rope_norm+packed": [
        ("static_kv_cache", {}),
        ("packed_projections", {}),
        ("fused_rope_norm", {}),
    ],
    "fused_rope_norm+graph": [
        ("static_kv_cache", {}),
        ("packed_projections", {}),
        ("decode_attention", {}),
        ("audio_head", {}),
        ("fused_rope_norm", {}),
        ("cuda_graph", {}),
    ],
    "pdl_technique": [  # PDL on every Triton kernel of an exact stack, captured
        ("static_kv_cache", {}),
        ("packed_projections", {}),
        ("decode_attention", {}),
        ("audio_head", {}),
        ("fused_rope_norm", {}),
        ("pdl", {}),
        ("cuda_graph", {}),
    ],
}


@pytest.fixture(scope="module")
def case128():
    model = FAMILY.build_model(ModelSpec(preset="small-128", device="cuda", dtype="bfloat16"))
    prompt = model.encode_prompt(
        build_prompt("A longer sentence, so the cache fills.", "Ira", None)
    )
    eng = stock_engine(model)
    with torch.inference_mode():
        tokens = eng.loop(
            eng, prompt, 12, SamplingConfig(), torch.Generator(device="cuda").manual_seed(5)
        ).tokens
    assert len(prompt) + len(tokens) > model.config.sliding_window  # crosses the window
    return model, prompt, fidelity.Reference.build(model, prompt, tokens, 0.8, 30)


@pytest.mark.parametrize("name", list(EXACT_128))
def test_exact_triton_and_graph_techniques(case128, name):
    model, _, ref = case128
    eng = build(model, EXACT_128[name])
    for _ in range(2):
        rec = ref.judge(eng)
        assert rec.within_tolerance, (name, rec)


def test_int8_is_close_but_not_exact(case128):
    model, _, ref = case128
    eng = build(model, [("static_kv_cache", {}), ("int8_projections", {})])
    rec = ref.judge(eng)
    assert rec.max_abs_logit_diff > 0  # it does change something
    assert rec.top1_agreement >= 0.8 and rec.mean_kl < 0.05, rec


def _generate(eng, prompt, frames, seed):
    with torch.inference_mode():
        return eng.loop(
            eng, prompt, frames, SamplingConfig(), torch.Generator(device="cuda").manual_seed(seed)
        )


def test_graph_loop_generates_valid_reproducible_tokens(case128):
    model, prompt, _ = case128
    exp74 = [*EXP74_BODY, ("graph_loop", {})]
    eng = build(model, exp74)
    a = _generate(eng, prompt, 10, seed=42)
    b = _generate(eng, prompt, 10, seed=42)
    c = _generate(eng, prompt, 10, seed=43)
    assert a.stop_reason == "length_policy" and len(a.tokens) == 80
    assert a.tokens == b.tokens and a.tokens != c.tokens
    vocab = model.vocab
    for i, tok in enumerate(a.tokens):  # the codebook head enforces q = step % 8
        assert vocab.first_unit_id <= tok <= vocab.last_unit_id
        assert (tok - vocab.first_unit_id) % 8 == i % 8
    # the model decides the length: a stop head that always fires ends at the 8th token
    model.stop_head[3].bias.data.fill_(1e4)
    try:
        eng2 = build(model, exp74)
        d = _generate(eng2, prompt, None, seed=1)
        assert d.stop_reason == "stop_head" and len(d.tokens) == 8
    finally:
        model.stop_head[3].bias.data.zero_()


def test_while_graph_generates_graph_loops_tokens(case128):
    """One conditional WHILE graph per utterance gives exactly graph_loop's tokens, under a
    length policy and when the model decides the length (end token, stop head)."""
    model, prompt, _ = case128
    body = [*EXP74_FULL_BODY, ("pdl", {})]
    host = build(model, [*body, ("graph_loop", {})])
    device = build(model, [*body, ("while_graph", {})])
    for seed in (42, 43):  # twice: the second launch reuses the instantiated graph
        a, b = _generate(host, prompt, 10, seed), _generate(device, prompt, 10, seed)
        assert b.stop_reason == "length_policy" and len(b.tokens) == 80
        assert a.tokens == b.tokens
    # the model decides the length: phase A runs min_tokens_before_stop tokens with the end
    # token masked, phase B until the sampled end token or the cap
    a, b = _generate(host, prompt, None, 7), _generate(device, prompt, None, 7)
    assert (a.stop_reason, a.tokens) == (b.stop_reason, b.tokens)
    model.stop_head[3].bias.data.fill_(1e4)  # a stop head that always fires
    try:
        eng = build(model, [*body, ("while_graph", {})])
        d = _generate(eng, prompt, None, seed=1)
        assert d.stop_reason == "stop_head" and len(d.tokens) == 8
    finally:
        model.stop_head[3].bias.data.zero_()


def test_while_graph_is_one_launch_per_utterance(case128):
    from orchestrate.api.config import Prompt, Workload

    model, _, _ = case128
    wl = Workload(name="w", prompts=[Prompt(id="a", text="A launch count.")], seeds=[3])
    eng = build(model, [*EXP74_BODY, ("while_graph", {})])
    counts = FAMILY.launches_per_step(eng, wl.prompts[0].text, 3, wl)
    assert counts["launches_per_step"] < 0.2, counts  # one graph launch for 24 tokens


def test_device_sampler_stays_in_allowed_columns(case128):
    model, prompt, _ = case128
    eng = build(model, [("audio_head", {}), ("device_sampler", {})])
    gen = _generate(eng, prompt, 4, seed=9)
    vocab = model.vocab
    assert len(gen.tokens) == 32
    assert all(vocab.first_unit_id <= t <= vocab.last_unit_id for t in gen.tokens)
    assert gen.tokens == _generate(eng, prompt, 4, seed=9).tokens


def test_fused_rope_norm_composes_with_int8_and_graph_loop(case128):
    """int8 + fused glue + graph capture: the int8 stack's logits (bf16 rounding order
    aside), and valid reproducible generation inside graph_loop."""
    model, prompt, ref = case128
    base = [("static_kv_cache", {}), ("int8_projections", {}), ("decode_attention", {})]
    plain = fidelity.teacher_forced(build(model, base), prompt, ref.tokens)
    graphed = build(model, [*base, ("fused_rope_norm", {}), ("cuda_graph", {})])
    for _ in range(2):
        other = fidelity.teacher_forced(graphed, prompt, ref.tokens)
        rec = fidelity.compare(plain, other, 0.8, 30, model.dtype)
        assert rec.top1_agreement >= 0.95 and rec.mean_kl < 1e-3, rec
    full = [
        *base,
        ("codebook_head", {}),
        ("fused_rope_norm", {}),
        ("device_sampler", {}),
        ("graph_loop", {}),
    ]
    eng = build(model, full)
    a, b = _generate(eng, prompt, 6, seed=42), _generate(eng, prompt, 6, seed=42)
    assert a.stop_reason == "length_policy" and len(a.tokens) == 48 and a.tokens == b.tokens


# ----------------------------------------------------------------------------- INT6


def test_int6_kernel_real_shapes_graph_and_pdl():
    """The INT6 GEMV at the real packed shapes, default and split-K configs, PDL, in a graph."""
    from orchestrate.techniques.rumik.kernels import int6_gemv as g6

    torch.manual_seed(0)
    for n, k in ((25088, 2048), (2048, 13056)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed, scale = g6.quantize_int6(w)
        assert packed.shape == (n, 3 * k // 4)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = g6.int6_linear_ref(x, packed, scale)
        for cfg in (None, g6.Int6Config(8, 128, 4, split_k=4), g6.Int6Config(16, 64, 4)):
            for pdl in (False, True):
                y = g6.int6_linear(x, packed, scale, config=cfg, launch_pdl=pdl)
                err = float((y.float() - ref.float()).norm() / ref.float().norm())
                assert err < 1e-2, (n, k, cfg, pdl, err)
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        g6.int6_linear(x, packed, scale, out=out, launch_pdl=True)  # warm-up outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g6.int6_linear(x, packed, scale, out=out, launch_pdl=True)
        for _ in range(3):
            x.normal_()
            graph.replay()
            torch.cuda.synchronize()
            ref = g6.int6_linear_ref(x, packed, scale)[0]
            assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def test_int6_is_close_but_further_than_int8(case128):
    model, _, ref = case128
    rec8 = ref.judge(build(model, [("static_kv_cache", {}), ("int8_projections", {})]))
    rec6 = ref.judge(build(model, [("static_kv_cache", {}), ("int6_projections", {})]))
    assert rec6.max_abs_logit_diff > 0 and not rec6.within_tolerance
    assert rec6.top1_agreement >= 0.7 and rec6.mean_kl < 0.2, rec6
    assert rec6.mean_kl > rec8.mean_kl, (rec6, rec8)


def test_int6_stack_generates_in_graph_loop(case128):
    model, prompt, _ = case128
    stack = [
        ("static_kv_cache", {}),
        ("int6_projections", {}),
        ("decode_attention", {}),
        ("codebook_head", {}),
        ("fused_rope_norm", {}),
        ("device_sampler", {}),
        ("graph_loop", {}),
    ]
    eng = build(model, stack)
    int8 = build(model, [("static_kv_cache", {}), ("int8_projections", {})])
    assert eng.projections.weight_bytes() < int8.projections.weight_bytes()
    a, b = _generate(eng, prompt, 6, seed=42), _generate(eng, prompt, 6, seed=42)
    assert a.stop_reason == "length_policy" and len(a.tokens) == 48 and a.tokens == b.tokens
    vocab = model.vocab
    assert all(vocab.first_unit_id <= t <= vocab.last_unit_id for t in a.tokens)


# ------------------------------------------------------------------------------ PDL


def test_pdl_technique_full_stack_matches_without_pdl(case128):
    """exp74-full (int8 + fused glue + PDL everywhere, graph_loop) generates the tokens the
    same stack without PDL generates: PDL changes launch overlap, not results."""
    model, prompt, _ = case128
    body = EXP74_FULL_BODY
    with_pdl = build(model, [*body, ("pdl", {}), ("graph_loop", {})])
    assert with_pdl.launch.pdl  # read by every kernel part at launch (tests/test_pdl.py)
    assert with_pdl.projections.launch_pdl
    without = build(model, [*body, ("graph_loop", {})])
    assert not without.launch.pdl
    a, b = _generate(with_pdl, prompt, 6, seed=42), _generate(without, prompt, 6, seed=42)
    assert a.stop_reason == "length_policy" and len(a.tokens) == 48
    same = sum(x == y for x, y in zip(a.tokens, b.tokens, strict=True)) / len(a.tokens)
    assert same >= 0.9, (a.tokens, b.tokens)  # bitwise equal unless a bf16 tie flips a draw


# ----------------------------------------------------------- kernel launches per step


def test_graph_kernel_nodes_and_profiler_agree():
    from orchestrate.api.device import count_launches, graph_kernel_nodes

    x = torch.randn(1024, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        y = x * 2
        y = y + 1
        y = torch.sin(y)
    graph.instantiate()
    assert graph_kernel_nodes(graph) == 3
    counts = count_launches(graph.replay, torch.device("cuda"))
    busy = counts.pop("busy_us")
    assert counts == {"kernels": 3, "launches": 1}, counts
    assert 0 < busy < 1000, busy  # three tiny kernels: microseconds of device time


def test_launches_per_step(case128):
    """Eager stock issues one host launch per kernel; graphs replace them with one launch;
    fused_rope_norm cuts kernels per step; graph_loop leaves one launch per token."""
    from orchestrate.api.config import Prompt, Workload

    model, _, _ = case128
    wl = Workload(name="w", prompts=[Prompt(id="a", text="A launch count.")], seeds=[3])

    def per_step(techniques):
        eng = stock_engine(model) if techniques is None else build(model, techniques)
        return FAMILY.launches_per_step(eng, wl.prompts[0].text, 3, wl)

    stock = per_step(None)
    assert stock["kernels_per_step"] > 50
    assert stock["launches_per_step"] >= 0.5 * stock["kernels_per_step"], stock
    graphed = [
        ("static_kv_cache", {}),
        ("packed_projections", {}),
        ("decode_attention", {}),
        ("audio_head", {}),
        ("cuda_graph", {}),
    ]
    g = per_step(graphed)
    assert g["launches_per_step"] < g["kernels_per_step"], g
    fused = per_step([*graphed[:-1], ("fused_rope_norm", {}), ("cuda_graph", {})])
    assert fused["kernels_per_step"] < g["kernels_per_step"], (fused, g)
    loop = per_step(
        [
            ("static_kv_cache", {}),
            ("int8_projections", {}),
            ("decode_attention", {}),
            ("codebook_head", {}),
            ("fused_rope_norm", {}),
            ("device_sampler", {}),
            ("pdl", {}),
            ("graph_loop", {}),
        ]
    )
    assert loop["launches_per_step"] <= 1.5 and loop["kernels_per_step"] > 10, loop


def test_into_gemv_matches_exp74_full_with_two_kernels_fewer_a_layer(case128):
    """fused_rope_norm's into_gemv (exp74-fused) against exp74-full: teacher-forced logits within
    rounding order of exp74-full's, the same tokens from graph_loop, two kernels fewer a layer."""
    from orchestrate.api.config import Prompt, Workload

    model, prompt, ref = case128
    fused_body = [*EXP74_BODY[:4], ("fused_rope_norm", {"into_gemv": True}), EXP74_BODY[4]]
    tokens = ref.tokens[:12]
    la = fidelity.teacher_forced(build(model, EXP74_FULL_BODY), prompt, tokens)
    lb = fidelity.teacher_forced(build(model, fused_body), prompt, tokens)
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean() >= 0.9
    cols = torch.isfinite(la)  # codebook_head leaves the other codebooks' columns at -inf
    assert torch.equal(cols, torch.isfinite(lb))
    a_, b_ = la[cols].float(), lb[cols].float()
    assert float((a_ - b_).norm() / a_.norm()) < 1e-2
    loop_a = build(model, [*EXP74_FULL_BODY, ("pdl", {}), ("graph_loop", {})])
    loop_b = build(model, [*fused_body, ("pdl", {}), ("graph_loop", {})])
    a, b = _generate(loop_a, prompt, 6, seed=42), _generate(loop_b, prompt, 6, seed=42)
    same = sum(x == y for x, y in zip(a.tokens, b.tokens, strict=True)) / len(a.tokens)
    assert same >= 0.9, (a.tokens, b.tokens)  # equal unless a bf16 tie flips a draw
    wl = Workload(name="w", prompts=[Prompt(id="a", text="A launch count.")], seeds=[3])
    ka = FAMILY.launches_per_step(loop_a, wl.prompts[0].text, 3, wl)["kernels_per_step"]
    kb = FAMILY.launches_per_step(loop_b, wl.prompts[0].text, 3, wl)["kernels_per_step"]
    layers = model.config.num_hidden_layers
    assert abs((ka - kb) - 2 * layers) < 0.5, (ka, kb, layers)
