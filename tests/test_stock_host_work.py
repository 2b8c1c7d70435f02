"""Our stock does no more work per token than the loop the model card describes.

Every "vs stock" figure divides by stock, so a stock made slower than upstream's would
inflate every speedup. Upstream's own `generate_audio` cannot be fetched here, so the
reference is that loop as shared/notes/models.md describes it, written plainly against
transformers (full LM forward with a DynamicCache and all hidden states, a fresh -inf mask
over the vocabulary, top-k 30 at T 0.8, the stop head read on the host after 8 tokens, the
token read on the host). Both loops run on the tiny model under one op counter
(TorchDispatchMode: every ATen op dispatched, and host syncs as `_local_scalar_dense`), and
ours must dispatch no more ops and no more syncs per token. What this cannot see: Python
time between the ops; on a GPU that is measured (`gpu_busy_ms_per_step` beside wall time).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from orchestrate.api.config import SamplingConfig
from orchestrate.families.rumik.engine import host_loop, stock_engine
from orchestrate.families.rumik.model import RumikModel
from orchestrate.families.rumik.vocab import build_prompt

FRAMES = 3  # 24 tokens: past the stop head's first read (after 8)


# The ways a tensor's value reaches Python (each a host sync on a GPU).
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class OpCounter(TorchDispatchMode):
    """Every ATen op dispatched, and every read of a tensor's value on the host."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.reads = 0
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any) -> Any:
            if self.active:
                self.reads += 1
            return original(tensor, *args)

        return read

    active = False

    def __enter__(self) -> OpCounter:
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.active = False
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def model_card_loop(model: RumikModel, prompt_ids: list[int], n: int, sampling: SamplingConfig,
                    generator: torch.Generator) -> list[int]:  # fmt: skip
    """The per-token loop as the model card describes it (see the module docstring)."""
    lm, vocab = model.lm, model.vocab
    cache = DynamicCache(config=lm.config)
    ids = torch.tensor([prompt_ids])
    tokens: list[int] = []
    for step in range(n):
        out = lm(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        logits, hidden = out.logits[:, -1, :].float(), out.hidden_states[-1][:, -1, :]
        if step >= sampling.min_tokens_before_stop:  # read, not obeyed (a length policy)
            bool(torch.sigmoid(model.stop_head(hidden).float()).item() > 0.5)
        mask = torch.full_like(logits, float("-inf"))
        mask[:, vocab.first_unit_id : vocab.last_unit_id + 1] = 0.0
        vals, idx = torch.topk((logits + mask) / sampling.temperature, sampling.top_k, dim=-1)
        pick = torch.multinomial(torch.softmax(vals, dim=-1), 1, generator=generator)
        token = idx.gather(-1, pick)
        tokens.append(int(token.item()))
        ids = token.view(1, 1)
    return tokens


def per_token(counter: OpCounter, n: int) -> tuple[float, float]:
    return sum(counter.ops.values()) / n, counter.reads / n


def test_our_stock_dispatches_no_more_ops_or_syncs_per_token(
    tiny_model: RumikModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampling = SamplingConfig()
    prompt = tiny_model.encode_prompt(build_prompt("A short test sentence.", "Ira", None))
    n = FRAMES * tiny_model.vocab.num_quantizers
    engine = stock_engine(tiny_model)
    with torch.inference_mode():  # warm both once: lazy initialisations are not per token
        host_loop(engine, prompt, 1, sampling, torch.Generator().manual_seed(0))
        model_card_loop(tiny_model, prompt, 8, sampling, torch.Generator().manual_seed(0))
    ours, card = OpCounter(monkeypatch), OpCounter(monkeypatch)
    with torch.inference_mode(), ours:
        got = host_loop(engine, prompt, FRAMES, sampling, torch.Generator().manual_seed(7))
    with card:
        ref = model_card_loop(tiny_model, prompt, n, sampling, torch.Generator().manual_seed(7))
    assert len(got.tokens) == len(ref) == n
    assert got.tokens == ref  # the same loop: the same draws from the same stream
    ours_ops, ours_syncs = per_token(ours, n)
    card_ops, card_syncs = per_token(card, n)
    # the token every step and the stop head after the first 8: ~1.7 reads a token
    assert card_syncs == (2 * n - sampling.min_tokens_before_stop) / n
    assert ours_syncs <= card_syncs, (ours_syncs, card_syncs)
    assert ours_ops <= card_ops, (ours_ops, card_ops, (ours.ops - card.ops).most_common(8))
