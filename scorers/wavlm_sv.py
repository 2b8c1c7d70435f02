"""Reference SIM: WavLM speaker-verification x-vectors through transformers (local weights only).

Weights: $ORCHESTRATE_WAVLM_SV (a from_pretrained folder holding a WavLMForXVector and its
feature-extractor config) or the Hugging Face cache entry of microsoft/wavlm-base-plus-sv.
Note: Seed-TTS-eval's SIM uses a WavLM-large + ECAPA-TDNN checkpoint that is not a
transformers model; numbers from this scorer are not interchangeable with theirs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import numpy as np

from orchestrate.api.scoring import SimScorer
from orchestrate.scorers._local import hf_weight_files, local_snapshot

REPO_ID = "microsoft/wavlm-base-plus-sv"
ENV_VAR = "ORCHESTRATE_WAVLM_SV"


class WavLmSv(SimScorer):
    name: ClassVar[str] = "wavlm_sv"
    version: ClassVar[str] = "1"
    reference: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("transformers", "torch")

    def _load(self) -> list[Path]:
        path = local_snapshot(REPO_ID, ENV_VAR, os.environ.get(ENV_VAR + "_REVISION"))
        files = hf_weight_files(path)
        import torch
        from transformers import Wav2Vec2FeatureExtractor, WavLMForXVector

        self._torch = torch
        self._device = "cuda" if torch.cuda.is_available() else "cpu"
        self._fe = Wav2Vec2FeatureExtractor.from_pretrained(path, local_files_only=True)
        model = WavLMForXVector.from_pretrained(path, local_files_only=True)
        self._model = model.to(self._device).eval()
        return files

    def embed(self, audio: np.ndarray) -> np.ndarray:
        # One utterance per call: no padding, so no attention-mask subtleties.
        inputs = self._fe(audio, sampling_rate=16000, return_tensors="pt")
        with self._torch.inference_mode():
            out = self._model(input_values=inputs.input_values.to(self._device))
        return out.embeddings[0].float().cpu().numpy()
