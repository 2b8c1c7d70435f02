"""Reference ASR: Whisper large-v3 through transformers, from local weights only.

Weights: $ORCHESTRATE_WHISPER_LARGE_V3 (a from_pretrained folder) or the Hugging Face cache
entry of openai/whisper-large-v3. Nothing is ever downloaded. Greedy decoding, as in
Seed-TTS-eval.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import numpy as np

from orchestrate.api.scoring import AsrScorer
from orchestrate.scorers._local import hf_weight_files, local_snapshot

REPO_ID = "openai/whisper-large-v3"
ENV_VAR = "ORCHESTRATE_WHISPER_LARGE_V3"
SHORT_FORM_S = 30  # Whisper's window; longer input takes the long-form (timestamped) path


class WhisperLargeV3(AsrScorer):
    name: ClassVar[str] = "whisper_large_v3"
    version: ClassVar[str] = "1"
    reference: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("transformers", "torch")

    def __init__(self, language: str = "en") -> None:
        super().__init__()
        self.language = language

    def _load(self) -> list[Path]:
        path = local_snapshot(REPO_ID, ENV_VAR, os.environ.get(ENV_VAR + "_REVISION"))
        files = hf_weight_files(path)
        import torch
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        self._device = "cuda" if torch.cuda.is_available() else "cpu"
        self._dtype = torch.float16 if self._device == "cuda" else torch.float32
        self._processor = WhisperProcessor.from_pretrained(path, local_files_only=True)
        model = WhisperForConditionalGeneration.from_pretrained(
            path, local_files_only=True, dtype=self._dtype
        )
        self._model = model.to(self._device).eval()
        return files

    def transcribe(self, audio: np.ndarray) -> str:
        import torch

        long_form = len(audio) > SHORT_FORM_S * 16000
        extra = {"truncation": False, "padding": "longest", "return_attention_mask": True}
        feats = self._processor(
            audio, sampling_rate=16000, return_tensors="pt", **(extra if long_form else {})
        )
        gen = {"language": self.language, "task": "transcribe", "num_beams": 1, "do_sample": False}
        if long_form:
            gen |= {"attention_mask": feats.attention_mask.to(self._device),
                    "return_timestamps": True}  # fmt: skip
        with torch.inference_mode():
            ids = self._model.generate(feats.input_features.to(self._device, self._dtype), **gen)
        return self._processor.batch_decode(ids, skip_special_tokens=True)[0].strip()
