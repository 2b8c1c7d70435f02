"""fp8_projections: FP8 (e4m3) projections for batched serving. What it rounds, how far its
logits move, that a row stays independent of its neighbours, what the server then holds,
and where the stack is refused. CPU (emulated: the same rounding, float32 matmuls) and GPU
(torch._scaled_mm)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from orchestrate.api.config import ModelSpec, SamplingConfig, StackSpec, TechniqueRef
from orchestrate.api.registry import StackError, build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.families.rumik.engine import tensor_bytes
from orchestrate.families.rumik.model import input_projections
from orchestrate.families.rumik.vocab import build_prompt
from orchestrate.techniques.rumik.batched_decode import BatchedDecoder
from orchestrate.techniques.rumik.batched_server import BatchedServer, ServeRequest
from orchestrate.techniques.rumik.fp8_projections import (
    FP8_MAX,
    Fp8Packed,
    Fp8Weight,
    fp8_linear,
    quantize_rows,
)

FAMILY = get_family("rumik")
GREEDY = SamplingConfig(top_k=1)
TOPK = SamplingConfig(top_k=8, temperature=0.9)
TEXTS = ["Hello there.", "A longer sentence to make a longer prompt.", "Short."]


@pytest.fixture(scope="module")
def model():
    return FAMILY.build_model(ModelSpec(preset="tiny", device="cpu", dtype="float32"))


def prompt(model, text: str) -> list[int]:
    return model.encode_prompt(build_prompt(text, "Ira", "neutral"))


def greedy_tokens(model, ids: list[int], steps: int) -> list[int]:
    dec = BatchedDecoder(model, 1, len(ids) + steps + 1, GREEDY)
    dec.prefill([0], [ids], [0], [False])
    return [int(dec.step(1, dec.capacity)[0]) for _ in range(steps)]


def test_each_value_is_rounded_within_e4m3s_step_under_its_rows_scale():
    """3 mantissa bits: a normal value moves by at most 2**-4 of itself; below e4m3's
    smallest normal (2**-6 of the scale) by at most half its subnormal step (2**-10). A row
    of zeros stays zeros and a huge row does not overflow into NaN."""
    torch.manual_seed(0)
    x = torch.randn(6, 256) * torch.logspace(-4, 4, 6)[:, None]
    x[0] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    back = q.float() * scale
    assert torch.isfinite(back).all() and (back[0] == 0).all()
    bound = x.abs() * 2**-4 + scale * 2**-10
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)  # peak -> 448
    assert (q.float().abs().amax(-1)[1:] == FP8_MAX).all()
    assert (back != x).any()  # it does round: not a pass-through


def test_an_fp8_weight_has_one_scale_per_output_channel():
    w = torch.randn(48, 32) * torch.linspace(0.01, 10, 48)[:, None]
    fw = Fp8Weight.of(w)
    assert fw.scale.shape == (1, 48)
    assert torch.allclose(fw.scale[0], w.abs().amax(-1) / FP8_MAX)
    x = torch.randn(5, 32)
    y = fp8_linear(x, fw, emulate=True)
    rel = (y - x @ w.t()).norm() / (x @ w.t()).norm()
    assert 0 < rel < 0.06, rel  # a few percent: every operand rounded to 3 mantissa bits


def test_fp8_logits_stay_near_bf16s_and_differ_from_them(model):
    """Teacher-forced on the tokens the exact step draws: every step's codebook logits
    keep a cosine above 0.99 with the exact step's, and are not equal to them."""
    ids = prompt(model, TEXTS[1])
    tokens = [greedy_tokens(model, ids, 24)]
    exact = BatchedDecoder(model, 1, 128, GREEDY).teacher_forced([ids], tokens)
    fp8 = BatchedDecoder(model, 1, 128, GREEDY, projections=Fp8Packed(model))
    ours = fp8.teacher_forced([ids], tokens)
    for (a, _), (b, _) in zip(exact, ours, strict=True):
        assert F.cosine_similarity(a[0], b[0], dim=0) > 0.99
    assert any(not torch.equal(a, b) for (a, _), (b, _) in zip(exact, ours, strict=True))


def test_a_rows_fp8_tokens_do_not_depend_on_its_neighbours(model):
    """Activations are scaled per row, so a row's products never see another row's values:
    each stream's tokens at batch 3 equal its tokens alone (seeded top-k)."""
    proj = Fp8Packed(model)
    reqs = [ServeRequest(k, prompt(model, t), 3, seed=5 + k) for k, t in enumerate(TEXTS)]

    def serve(rows: int, batch: list[ServeRequest]) -> dict[int, list[int]]:
        server = BatchedServer(model, rows, 256, TOPK, graphs=False, codec=False, projections=proj)
        waiting = list(batch)
        while waiting or server.live():
            waiting = waiting[server.admit(waiting) :]
            server.step()
        return server.tokens

    together = serve(3, reqs)
    for r in reqs:
        assert serve(1, [r])[r.key] == together[r.key]


def test_the_server_counts_fp8_weights_as_read_and_the_bf16_originals_as_unread(model):
    bf16 = BatchedServer(model, 2, 64, GREEDY, graphs=False, codec=False).memory()
    proj = Fp8Packed(model)
    fp8 = BatchedServer(model, 2, 64, GREEDY, graphs=False, codec=False, projections=proj).memory()
    layers = model.lm.model.layers
    originals = tensor_bytes(
        *(p.weight for layer in layers for p in input_projections(layer)),
        *(layer.self_attn.o_proj.weight for layer in layers),
        *(layer.mlp.down_proj.weight for layer in layers),
    )
    assert fp8["weights_unread"] - bf16["weights_unread"] == originals
    assert fp8["weights_read"] == bf16["weights_read"] - originals + proj.weight_bytes()
    assert fp8["weights_copied"] - bf16["weights_copied"] == proj.weight_bytes()
    assert proj.weight_bytes() < originals / 3  # 1 byte a weight against float32's 4


def fp8_stack(*names: str) -> StackSpec:
    params = {"batched_decode": {"rows": 4}}
    refs = [TechniqueRef(name=n, params=params.get(n, {})) for n in names]
    return StackSpec(name="fp8-serving", family="rumik", techniques=refs)


def test_a_parked_fp8_server_holds_only_what_it_reads_and_serves_the_same_tokens(model):
    """Parked (api/parking.py), the bf16 originals leave the device for the run: the server
    still serves every token it served with them present (a read of one would fail: a
    parked weight is empty), and after the block the model is whole again, its q,k,v,gate,up
    still views of one packed storage."""
    from orchestrate.families.rumik.model import packed_input_weight

    layer = model.lm.model.layers[0]
    before = [p.weight.clone() for p in input_projections(layer)]
    packed_before = packed_input_weight(layer) is not None
    proj = Fp8Packed(model)
    reqs = [ServeRequest(k, prompt(model, t), 3, seed=5 + k) for k, t in enumerate(TEXTS)]

    def serve(park: bool) -> tuple[dict[int, list[int]], dict[str, int]]:
        server = BatchedServer(model, 3, 256, TOPK, graphs=False, codec=False, projections=proj)
        with server.parked() if park else contextlib.nullcontext():
            held = server.memory()
            waiting = list(reqs)
            while waiting or server.live():
                waiting = waiting[server.admit(waiting) :]
                server.step()
        return server.tokens, held

    tokens, held = serve(park=False)
    parked_tokens, parked_held = serve(park=True)
    assert parked_tokens == tokens
    assert held["weights_unread"] > 0 and parked_held["weights_unread"] == 0
    assert parked_held["weights_parked"] == held["weights_unread"]
    assert parked_held["weights_read"] == held["weights_read"]
    after = [p.weight for p in input_projections(layer)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert packed_before and packed_input_weight(layer) is not None


def test_fp8_projections_is_refused_where_nothing_would_read_it_and_on_the_cpu():
    with pytest.raises(StackError, match="needs 'batched_decode' applied before it"):
        build_stack(fp8_stack("fp8_projections"))
    with pytest.raises(StackError, match="needs 'batched_decode' applied before it"):
        build_stack(fp8_stack("fp8_projections", "batched_decode"))
    with pytest.raises(StackError, match="cannot run here: needs a CUDA device"):
        build_stack(fp8_stack("batched_decode", "fp8_projections"), DeviceCaps("cpu"), strict=True)
    hopper = DeviceCaps("cuda", (9, 0), "H200")
    assert build_stack(fp8_stack("batched_decode", "fp8_projections"), hopper, strict=True)
    ampere = DeviceCaps("cuda", (8, 0), "A100")
    with pytest.raises(StackError, match="needs a Hopper GPU"):
        build_stack(fp8_stack("batched_decode", "fp8_projections"), ampere, strict=True)


def test_the_gemm_is_a_param_and_an_unknown_one_is_refused(model):
    """`gemm: triton` reaches the projections the server reads; a name neither GEMM has
    fails when the stack is built, and when the projections are made by hand."""
    stack = fp8_stack("batched_decode", "fp8_projections")
    stack.techniques[1] = TechniqueRef(name="fp8_projections", params={"gemm": "triton"})
    engine = FAMILY.build_engine(model, build_stack(stack))
    assert engine.server(engine, 64, GREEDY, 1, rows=2).dec.proj.gemm == "triton"
    stack.techniques[1] = TechniqueRef(name="fp8_projections", params={"gemm": "cutlass"})
    with pytest.raises(StackError, match="gemm"):
        build_stack(stack)
    with pytest.raises(ValueError, match="fp8 gemm 'cutlass': one of cublas, triton"):
        Fp8Packed(model, gemm="cutlass")  # type: ignore[arg-type]


def test_the_batched_server_reads_the_fp8_slot(model):
    """The stack applied (requirements unchecked, so the CPU emulates): the engine's server
    steps through the FP8 projections, not its own bf16 ones."""
    built = build_stack(fp8_stack("batched_decode", "fp8_projections"))
    engine = FAMILY.build_engine(model, built)
    server = engine.server(engine, 64, GREEDY, 1, rows=2)
    assert isinstance(server.dec.proj, Fp8Packed) and server.dec.proj is engine.projections
    plain = FAMILY.build_engine(model, build_stack(fp8_stack("batched_decode")))
    assert not isinstance(plain.server(plain, 64, GREEDY, 1, rows=2).dec.proj, Fp8Packed)


@pytest.mark.gpu
def test_the_gpu_gives_the_emulated_fp8_products():
    """cuBLASLt's FP8 GEMM (many rows) and the GEMV (one row) against float32 matmuls of the
    same dequantized operands, at the real model's projection shapes: only the summation
    order and bf16 output differ."""
    torch.manual_seed(0)
    for m, k, n in ((1, 2048, 25088), (1, 11008, 2048), (64, 2048, 2048), (512, 11008, 2048)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = Fp8Weight.of(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        ours, ref = fp8_linear(x, w, emulate=False), fp8_linear(x.float(), w, emulate=True)
        assert ours.dtype == torch.bfloat16
        err = (ours.float() - ref).abs().max() / ref.abs().max()
        assert err < 1e-2, (m, k, n, float(err))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 64, 200, 512])
def test_the_triton_fp8_gemm_is_as_near_the_exact_product_as_cublas(m):
    """kernels/fp8_gemm.py (the table's tile, else the plain one; split-K where the table
    has it) at the three projection shapes against the float32 product of the dequantized
    operands: within bf16's step of the largest output, and no farther than cuBLASLt's GEMM
    (precise accumulation, its default) over the same operands, up to 2x. Its fast
    accumulation (the whole K in the tensor cores) is measured beside it, not held to it."""
    from dataclasses import replace

    from orchestrate.techniques.rumik.kernels.fp8_gemm import config_for, default_config, fp8_gemm

    torch.manual_seed(m)
    for k, n in ((2048, 25088), (2048, 2048), (11008, 2048)):
        xq, xs = quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        w = Fp8Weight.of(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        ref = (xq.float() * xs) @ (w.q.float() * w.scale.t()).t()
        cfg = config_for(m, n, k) or default_config(m, n, k)
        ours = fp8_gemm(xq, xs, w.q, w.scale, cfg)
        fast = fp8_gemm(xq, xs, w.q, w.scale, replace(cfg, precise=False))
        cublas = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale, out_dtype=ours.dtype)
        assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
        err = {
            name: float((y.float() - ref).abs().max() / ref.abs().max())
            for name, y in (("ours", ours), ("fast", fast), ("cublas", cublas))
        }
        where = f"{m}x{k}x{n} {cfg.label()}: {err}"
        assert err["ours"] <= 2**-8, where
        assert err["ours"] <= 2 * err["cublas"], where


@pytest.mark.gpu
def test_fp8_serving_on_gpu_stays_near_bf16_and_near_its_emulation():
    gpu = FAMILY.build_model(ModelSpec(preset="tiny", device="cuda", dtype="bfloat16"))
    ids = prompt(gpu, TEXTS[1])
    tokens = [greedy_tokens(gpu, ids, 24)]
    exact = BatchedDecoder(gpu, 1, 128, GREEDY).teacher_forced([ids], tokens)
    runs = {}
    for emulate in (False, True):
        dec = BatchedDecoder(gpu, 1, 128, GREEDY, projections=Fp8Packed(gpu, emulate=emulate))
        runs[emulate] = dec.teacher_forced([ids], tokens)
    for (a, _), (b, _), (c, _) in zip(exact, runs[False], runs[True], strict=True):
        assert F.cosine_similarity(a[0].float(), b[0].float(), dim=0) > 0.98
        assert F.cosine_similarity(b[0].float(), c[0].float(), dim=0) > 0.999


def test_explorations_are_not_offered_what_only_a_server_reads():
    """An exploration compares one utterance at a time: neither the batched server nor the
    FP8 projections only it reads are in its catalogue."""
    from orchestrate.explore.state import technique_catalogue

    offered = technique_catalogue("rumik")
    assert "packed_projections" in offered
    assert "fp8_projections" not in offered and "batched_decode" not in offered


@pytest.mark.parametrize("kv", ["fp8", "int4"])
def test_a_quantized_cache_without_the_kernel_that_reads_its_scales_is_refused_at_build(kv):
    spec = StackSpec(
        name="kv8",
        family="rumik",
        techniques=[TechniqueRef(name="batched_decode", params={"rows": 4, "kv": kv})],
    )
    with pytest.raises(StackError, match=f"kv '{kv}' needs attention 'triton'"):
        build_stack(spec)
    triton = spec.techniques[0].params | {"attention": "triton"}
    spec = spec.model_copy(
        update={"techniques": [TechniqueRef(name="batched_decode", params=triton)]}
    )
    assert build_stack(spec).techniques[0].params.kv == kv


def test_the_gemm_table_is_the_sweeps_fastest_tile_where_it_beat_cublas():
    """kernels/fp8_gemm.py's TABLE is read off the committed sweep (fp8-gemm-sweep.json):
    at every row count and shape swept, `config_for` gives the fastest tile where it was
    faster than cuBLASLt, and None (cuBLASLt) where it was not."""
    import json
    from pathlib import Path

    from orchestrate.techniques.rumik.kernels.fp8_gemm import config_for

    record = Path(__file__).resolve().parents[1] / "benchmarks/h100/serving/fp8-gemm-sweep.json"
    levels = json.loads(record.read_text())["sweep"]
    assert len(levels) == 12  # 4 row counts x 3 shapes
    for lv in levels:
        tiles = {k: v for k, v in lv["median_ms_36"].items() if k not in ("cublas", "config_for")}
        best = min(tiles, key=tiles.__getitem__)
        want = best if tiles[best] < lv["median_ms_36"]["cublas"] else None
        cfg = config_for(lv["rows"], lv["n"], lv["k"])
        assert (cfg.label() if cfg else None) == want, lv["rows"]


def test_gemm_triton_takes_the_kernel_only_where_its_table_has_a_tile(monkeypatch):
    """fp8_matmul with `gemm: triton` on CUDA: the table's tile where it has one (64 rows of
    q,k,v,gate,up), cuBLASLt where it has none (200 rows of the same shape); `cublas` never
    the kernel. Both GEMMs replaced by recorders: the dispatch alone, on any machine."""
    import orchestrate.techniques.rumik.kernels.fp8_gemm as kernel
    from orchestrate.techniques.rumik.fp8_projections import fp8_matmul

    calls: list[tuple[str, object]] = []

    def triton(xq, xs, wq, ws, config=None):
        calls.append(("triton", config))
        return torch.zeros(xq.shape[0], wq.shape[0], dtype=torch.bfloat16)

    def cublas(a, b, scale_a, scale_b, out_dtype):
        calls.append(("cublas", None))
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(kernel, "fp8_gemm", triton)
    monkeypatch.setattr(torch, "_scaled_mm", cublas)
    w = Fp8Weight(torch.empty(25088, 2048, dtype=torch.float8_e4m3fn), torch.ones(1, 25088))
    for m, gemm in ((64, "triton"), (200, "triton"), (64, "cublas")):
        xq = torch.empty(m, 2048, dtype=torch.float8_e4m3fn)
        fp8_matmul(xq, torch.ones(m, 1), w, False, torch.bfloat16, gemm)
    assert calls == [("triton", kernel.config_for(64, 25088, 2048)), ("cublas", None),
                     ("cublas", None)]  # fmt: skip
