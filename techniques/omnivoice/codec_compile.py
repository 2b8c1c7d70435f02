"""The codec, batched and compiled: one decoder call per batch, inductor + CUDA graphs.

Stock decodes each item by itself with the Higgs audio tokenizer in eager mode: an RVQ
lookup, a linear, then a convolutional decoder whose Snake activations are several small
elementwise kernels each. On the H200 that took ~15 ms for a 2 s clip, as long as the ten
compiled unmasking forwards (benchmarks/h200/issue5-profile-step.json), and batch B paid it
B times. Here items of the same length are stacked and decoded in one call through
torch.compile (reduce-overhead by default: one CUDA graph per batch shape, captured on the
shape's second call, so warm-ups must cover each shape). Long-form items (lists of chunks)
keep the package's per-chunk decode and cross-fade. Post-processing is the package's.

Exact in math (the same decoder; batching and fusion change only rounding): the CPU test
checks the batched eager decode against the package per item, the GPU test the compiled
one within a stated tolerance.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from orchestrate.api.technique import Refused, Technique, TechniqueParams
from orchestrate.techniques.omnivoice.torch_compile import raise_recompile_limit


class CodecCompileParams(TechniqueParams):
    mode: Literal["none", "default", "reduce-overhead", "max-autotune-no-cudagraphs"] = Field(
        "reduce-overhead", description="torch.compile mode of the decoder; none = batched eager"
    )


class BatchedCodec:
    """The `codec` slot: same-length items decoded together by one (compiled) decoder."""

    def __init__(self, tokenizer: Any, mode: str):
        self.tokenizer = tokenizer
        self.mode = mode
        self.decode = self._decode
        if mode != "none":
            raise_recompile_limit()
            self.decode = torch.compile(self._decode, mode=mode, dynamic=False)

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.tokenizer.decode(codes, return_dict=False)

    @torch.inference_mode()
    def waveforms(self, codes: torch.Tensor) -> np.ndarray:
        """[N, C, T] codes -> [N, samples] float waveforms on the CPU."""
        codes = codes.to(self.tokenizer.device)
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        out = self.decode(codes)
        return out[:, 0].float().cpu().numpy()  # copied out before the graph's next replay

    def __call__(
        self, engine: Any, codes: list[Any], rms: list[float | None], cfg: Any
    ) -> list[np.ndarray]:
        ov = engine.model.ov
        raw: list[np.ndarray | None] = [None] * len(codes)
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, c in enumerate(codes):
            if not isinstance(c, list):  # long-form chunk lists: the package's own path below
                by_length[c.shape[-1]].append(i)
        for idx in by_length.values():
            waves = self.waveforms(torch.stack([codes[i] for i in idx]))
            for i, w in zip(idx, waves, strict=True):
                raw[i] = w
        audios = []
        for i, c in enumerate(codes):
            if raw[i] is None:
                audios.append(ov._decode_and_post_process(c, rms[i], cfg))
            else:  # the package's own post-processing, on a [1, samples] waveform
                audios.append(
                    ov._post_process_audio(raw[i][None], ref_rms=rms[i], gen_config=cfg).squeeze(0)
                )
        return audios


class CodecCompile(Technique):
    name = "codec_compile"
    family = "omnivoice"
    exact = True
    slots = ("codec",)
    summary = "same-length items decoded in one codec call, torch.compile'd (CUDA graphs)"
    Params = CodecCompileParams

    def apply(self, engine: Any) -> None:
        if self.params.mode != "none" and engine.model.device.type != "cuda":
            raise Refused(f"codec_compile mode {self.params.mode!r} is for CUDA; use mode none")
        engine.codec = BatchedCodec(engine.model.ov.audio_tokenizer, self.params.mode)
