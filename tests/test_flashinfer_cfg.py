"""flashinfer_packed_cfg: the packed forward equals the package's at every position
slot_loop reads (CPU, fp32, backend 'torch'); FlashInfer is refused where it cannot run;
on a GPU (backend 'flashinfer', bf16) it is as close to fp32 as the package itself is.

Skipped where `omnivoice` cannot be imported.
"""

# ruff: noqa: E402 -- imports follow require_or_skip: they need omnivoice
from __future__ import annotations

import copy
import sys
import types
from typing import ClassVar

import pytest
import torch
from conftest import require_or_skip

require_or_skip("omnivoice")  # needs a torchaudio that matches torch

from omnivoice_fixtures import engine_for

from orchestrate.api.config import ModelSpec, StackSpec
from orchestrate.api.registry import StackError, build_stack
from orchestrate.api.technique import DeviceCaps, Refused
from orchestrate.families.omnivoice.engine import build_cfg_batch, slot_loop, stock_engine
from orchestrate.techniques.omnivoice import flashinfer_cfg
from orchestrate.techniques.omnivoice.flashinfer_cfg import packed_forward

TEXTS = ["The morning train was late again.", "Short, then a much longer sentence follows."]
# fp32 on the tiny model: packing changes only the SDPA call's length (no padded keys), so
# the two agree to rounding; logits have std ~0.16 here.
FP32_ATOL = 1e-5


def read_mask(c_lens, t_lens, rows, seq) -> torch.Tensor:
    """[R, S] True where slot_loop reads: cond rows' last t_len valid, uncond rows' first."""
    b = len(c_lens)
    read = torch.zeros(rows, seq, dtype=torch.bool)
    for i in range(b):
        read[i, c_lens[i] - t_lens[i] : c_lens[i]] = True
        if b + i < rows:
            read[b + i, : t_lens[i]] = True
    return read


def compare(want, got, read):
    """Max |diff| at the read positions; positions never read must be zero."""
    w, g = want.permute(0, 2, 1, 3), got.permute(0, 2, 1, 3)  # [R, S, C, V]
    assert not bool(g[~read.to(g.device)].any())
    return float((w[read] - g[read]).abs().max())


def test_packed_torch_backend_equals_the_package_forward(model):
    ov, eng = model.ov, stock_engine(model, reimplemented=True)
    task = ov._preprocess_all(text=TEXTS)
    batch = build_cfg_batch(eng, task, eng.config())
    assert len(set(batch.c_lens)) == 2  # cond rows padded too, not only uncond rows
    forward = packed_forward(ov, "torch")
    seq = batch.input_ids.shape[-1]
    with torch.inference_mode():
        for rows in (4, 2, 4):  # CFG, cond rows only (cfg_late_off), CFG again
            args = (batch.input_ids[:rows], batch.audio_mask[:rows], batch.attention_mask[:rows])
            want, got = eng.forward(*args).float(), forward(*args).float()
            read = read_mask(batch.c_lens, batch.t_lens, rows, seq)
            assert compare(want, got, read) < FP32_ATOL
    assert sorted(forward.cache.by_rows) == [2, 4]


def test_row_lengths_are_read_once_per_synthesis(model, monkeypatch):
    ov, eng = model.ov, stock_engine(model, reimplemented=True)
    calls = []
    real = flashinfer_cfg.row_lengths
    monkeypatch.setattr(flashinfer_cfg, "row_lengths", lambda m: calls.append(1) or real(m))
    forward = packed_forward(ov, "torch")
    with torch.inference_mode():
        for text in TEXTS:  # two syntheses: a new batch mask is a new layout
            batch = build_cfg_batch(eng, ov._preprocess_all(text=[text]), eng.config())
            for rows in (2, 2, 1, 1):
                forward(
                    batch.input_ids[:rows], batch.audio_mask[:rows], batch.attention_mask[:rows]
                )
    assert len(calls) == 2


def test_not_a_block_mask_is_an_error(model):
    ov, eng = model.ov, stock_engine(model, reimplemented=True)
    batch = build_cfg_batch(eng, ov._preprocess_all(text=[TEXTS[0]]), eng.config())
    causal = batch.attention_mask & torch.ones_like(batch.attention_mask).tril()
    with pytest.raises(ValueError, match="not a per-row non-causal block mask"):
        packed_forward(ov, "torch")(batch.input_ids, batch.audio_mask, causal)


def test_torch_backend_stack_gives_stock_codes(family, model):
    def codes(engine):
        cfg = engine.config()
        task = engine.model.ov._preprocess_all(text=[TEXTS[0]])
        torch.manual_seed(11)
        return engine.generate_codes(task, cfg)[0]

    packed = {"name": "flashinfer_packed_cfg", "params": {"backend": "torch"}}
    eng = engine_for(family, model, packed)
    assert eng.loop is slot_loop and eng.filled["forward"] == "flashinfer_packed_cfg"
    assert torch.equal(codes(eng), codes(stock_engine(model)))


class FakeRaggedWrapper:
    """FlashInfer's ragged prefill wrapper's interface, computed with SDPA: lets the CPU
    check the flashinfer backend's plumbing (what is planned, how often, what runs)."""

    plans: ClassVar[list[dict]] = []

    def __init__(self, workspace, layout, backend="auto"):
        assert layout == "NHD" and workspace.dtype == torch.uint8

    def plan(self, qo_indptr, kv_indptr, heads_q, heads_kv, head_dim, **kw):
        assert torch.equal(qo_indptr, kv_indptr) and qo_indptr.dtype == torch.int32
        self.indptr, self.scale = qo_indptr.tolist(), kw["sm_scale"]
        FakeRaggedWrapper.plans.append({"heads": (heads_q, heads_kv, head_dim), **kw})

    def run(self, q, k, v):
        layout = types.SimpleNamespace(indptr=self.indptr)
        return flashinfer_cfg.torch_attend(layout, q, k, v, self.scale)


def test_flashinfer_backend_plumbing_with_a_fake_kernel(model, monkeypatch):
    fake = types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=FakeRaggedWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    FakeRaggedWrapper.plans.clear()
    ov, eng = model.ov, stock_engine(model, reimplemented=True)
    batch = build_cfg_batch(eng, ov._preprocess_all(text=TEXTS), eng.config())
    forward, seq = packed_forward(ov, "flashinfer"), batch.input_ids.shape[-1]
    with torch.inference_mode():
        for rows in (4, 4, 2, 2, 4):  # steps of one synthesis, CFG dropped late
            args = (batch.input_ids[:rows], batch.audio_mask[:rows], batch.attention_mask[:rows])
            read = read_mask(batch.c_lens, batch.t_lens, rows, seq)
            assert compare(eng.forward(*args).float(), forward(*args).float(), read) < FP32_ATOL
    assert len(FakeRaggedWrapper.plans) == 2  # once per layout, not per step or layer
    plan = FakeRaggedWrapper.plans[0]
    assert plan["heads"] == (4, 2, 16) and plan["causal"] is False
    assert plan["q_data_type"] == plan["kv_data_type"] == torch.float32


def test_flashinfer_backend_is_refused_with_the_reason(family, model, monkeypatch):
    with pytest.raises(Refused, match="FlashInfer needs a CUDA GPU; the model is on cpu"):
        engine_for(family, model, {"name": "flashinfer_packed_cfg"})
    monkeypatch.setattr(flashinfer_cfg.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(Refused, match="'flashinfer' is not installed.*backend 'torch'"):
        engine_for(family, model, {"name": "flashinfer_packed_cfg"})


def test_filled_after_torch_compile_is_refused():
    spec = StackSpec(
        name="s",
        family="omnivoice",
        techniques=[{"name": "torch_compile"}, {"name": "flashinfer_packed_cfg"}],
    )
    with pytest.raises(StackError, match="before torch_compile"):
        build_stack(spec)


def test_cpu_compile_of_the_packed_forward_is_exact(model):
    """Under torch.compile the layout lookup is a graph break (host bookkeeping); compiled,
    the packed forward still equals the package's unpacked one where slot_loop reads."""
    from orchestrate.techniques.omnivoice.torch_compile import compile_forward

    ov, eng = model.ov, stock_engine(model, reimplemented=True)
    batch = build_cfg_batch(eng, ov._preprocess_all(text=[TEXTS[0]]), eng.config())
    args = (batch.input_ids, batch.audio_mask, batch.attention_mask)
    rows, _, seq = batch.input_ids.shape
    read = read_mask(batch.c_lens, batch.t_lens, rows, seq)
    compiled = compile_forward(packed_forward(ov, "torch"), mode="default", fullgraph=False)
    with torch.inference_mode():
        want = eng.forward(*args).float()  # the package's forward: padded, not packed
        assert compare(want, compiled(*args).float(), read) < FP32_ATOL


# ------------------------------------------------------------------- GPU


def medium_ov(layers: int = 4, device: str = "cuda"):
    """The real backbone shape (hidden 1024, 16/8 heads, head_dim 128), fewer layers,
    random weights, built directly (no codec or tokenizer: the forward does not use them)."""
    from omnivoice import OmniVoice, OmniVoiceConfig
    from transformers import Qwen3Config

    from orchestrate.families.omnivoice.presets import OMNIVOICE

    torch.manual_seed(0)
    llm = Qwen3Config(**{**OMNIVOICE.llm, "num_hidden_layers": layers})
    llm._attn_implementation = "sdpa"
    with torch.device(device):
        return OmniVoice(OmniVoiceConfig(llm_config=llm)).eval()


def synthetic_cfg_batch(c_lens, t_lens, codebooks=8, text_vocab=4096, device="cuda"):
    """build_cfg_batch's layout with random ids, a third of the targets still masked."""
    b, seq, mask_id = len(c_lens), max(c_lens), 1024
    ids = torch.full((2 * b, codebooks, seq), mask_id, dtype=torch.long)
    audio = torch.zeros(2 * b, seq, dtype=torch.bool)
    attn = torch.zeros(2 * b, 1, seq, seq, dtype=torch.bool)
    for i, (c, t) in enumerate(zip(c_lens, t_lens, strict=True)):
        row = torch.randint(0, mask_id, (codebooks, c))
        row[:, : c - t] = torch.randint(0, text_vocab, (1, c - t))
        row[:, c - t :][torch.rand(codebooks, t) < 0.33] = mask_id
        ids[i, :, :c], audio[i, c - t : c], attn[i, :, :c, :c] = row, True, True
        ids[b + i, :, :t], audio[b + i, :t], attn[b + i, :, :t, :t] = row[:, -t:], True, True
        pad = torch.arange(t, seq)
        attn[b + i, :, pad, pad] = True
    return ids.to(device), audio.to(device), attn.to(device)


@pytest.mark.gpu
def test_flashinfer_backend_matches_the_package_forward_in_bf16():
    """Tolerance: against the fp32 package forward, FlashInfer's bf16 error at the read
    positions is at most 2x the package's own bf16 error (+1e-3 std), and its top-1
    agreement with fp32 is within 2 points of the package's. Zero where not read."""
    require_or_skip("flashinfer", gpu=True)  # on a CUDA host: installed, or a failure
    ov32 = medium_ov()
    ov16 = copy.deepcopy(ov32).bfloat16()
    c_lens, t_lens = [330, 262], [221, 150]
    ids, audio, attn = synthetic_cfg_batch(c_lens, t_lens)
    fi = packed_forward(ov16, "flashinfer")
    with torch.inference_mode():
        for rows in (4, 2, 4):
            args = (ids[:rows], audio[:rows], attn[:rows])
            read = read_mask(c_lens, t_lens, rows, ids.shape[-1]).cuda()
            kw = dict(zip(("input_ids", "audio_mask", "attention_mask"), args, strict=True))
            ref = ov32(**kw).logits.float().permute(0, 2, 1, 3)[read]
            pkg = ov16(**kw).logits.float().permute(0, 2, 1, 3)[read]
            got = fi(*args).float()
            assert not bool(got.permute(0, 2, 1, 3)[~read].any())
            got = got.permute(0, 2, 1, 3)[read]
            err_pkg, err_fi = (pkg - ref).abs().max(), (got - ref).abs().max()
            assert float(err_fi) <= 2 * float(err_pkg) + 1e-3 * float(ref.std())
            top1_fi, top1_pkg = (
                float((x.argmax(-1) == ref.argmax(-1)).float().mean()) for x in (got, pkg)
            )
            assert top1_fi >= top1_pkg - 0.02
    assert sorted(fi.cache.by_rows) == [2, 4]  # planned once per row count, reused


@pytest.mark.gpu
def test_flashinfer_stack_builds_on_cuda(family):
    """The stack is accepted on the GPU with FlashInfer installed; on the tiny preset
    (head_dim 16) FlashInfer's kernels do not apply and that is said."""
    require_or_skip("flashinfer", gpu=True)  # on a CUDA host: installed, or a failure
    from orchestrate.api.technique import UnsupportedConfig

    model = family.build_model(ModelSpec(family="omnivoice", preset="tiny", device="cuda"))
    with pytest.raises(UnsupportedConfig, match="head_dim"):
        engine_for(family, model, {"name": "flashinfer_packed_cfg"}, caps=DeviceCaps.probe("cuda"))
