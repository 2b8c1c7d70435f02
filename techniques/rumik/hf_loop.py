"""Baseline B's loop: transformers' generate() with a static cache, restricted to the
audio vocabulary by a logits processor (techniques/rumik/hf_generate.py says why it is a
baseline). Its own module so that listing techniques does not import transformers'
generation code."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from orchestrate.api.config import SamplingConfig
from orchestrate.families.rumik.engine import Engine, Generation, token_budget


class AudioOnly(LogitsProcessor):
    def __init__(self, lo: int, hi: int, end_id: int, allow_end_from: int | None, prompt_len: int):
        self.lo, self.hi, self.end_id = lo, hi, end_id
        self.allow_end_from, self.prompt_len = allow_end_from, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        keep = torch.full_like(scores, float("-inf"))
        keep[:, self.lo : self.hi] = 0
        step = input_ids.shape[1] - self.prompt_len
        if self.allow_end_from is not None and step >= self.allow_end_from:
            keep[:, self.end_id] = 0
        return scores + keep


def hf_generate_loop(
    engine: Engine,
    prompt_ids: list[int],
    frames: int | None,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> Generation:
    model, vocab = engine.model, engine.model.vocab
    cap = token_budget(sampling, frames, vocab.num_quantizers)
    torch.manual_seed(generator.initial_seed())  # generate() draws from the global RNG
    ids = torch.tensor([prompt_ids], device=model.device)
    processor = AudioOnly(
        vocab.first_unit_id,
        vocab.last_unit_id + 1,
        vocab.end_id,
        None if frames is not None else sampling.min_tokens_before_stop,
        len(prompt_ids),
    )
    out = model.lm.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=cap,
        min_new_tokens=cap if frames is not None else 0,
        do_sample=True,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        cache_implementation="static",
        logits_processor=LogitsProcessorList([processor]),
        eos_token_id=vocab.end_id,
        pad_token_id=vocab.end_id,
    )
    tokens = out[0, len(prompt_ids) :].tolist()
    if vocab.end_id in tokens:
        return Generation(tokens[: tokens.index(vocab.end_id)], "end_token")
    return Generation(tokens, "token_cap" if frames is None else "length_policy")
