"""Offline default SIM: Resemblyzer d-vectors (GE2E LSTM; weights in the resemblyzer wheel).

Resemblyzer's VAD dependency, webrtcvad, imports pkg_resources, which setuptools 81 removed:
the `quality` extra pins setuptools<81 for that reason.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np

from orchestrate.api.scoring import CoverageFailure, ScorerUnavailable, SimScorer


class Resemblyzer(SimScorer):
    name: ClassVar[str] = "resemblyzer"
    version: ClassVar[str] = "1"
    default: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("resemblyzer", "webrtcvad")

    def _load(self) -> list[Path]:
        with warnings.catch_warnings():
            # pkg_resources and scipy.ndimage.morphology deprecation notices, not our concern.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            try:
                import resemblyzer
                from resemblyzer import VoiceEncoder, preprocess_wav
            except ModuleNotFoundError as e:
                if e.name != "pkg_resources":
                    raise
                raise ScorerUnavailable(
                    "webrtcvad needs pkg_resources, gone since setuptools 81: "
                    "pip install 'setuptools<81'"
                ) from e
        weights = Path(resemblyzer.__file__).parent / "pretrained.pt"
        self._encoder = VoiceEncoder(device="cpu", verbose=False, weights_fpath=weights)
        self._preprocess = preprocess_wav
        return [weights]

    def embed(self, audio: np.ndarray) -> np.ndarray:
        # Audio is at 16 kHz already, so no source_sr: preprocess only normalises the volume
        # and trims long silences (webrtcvad).
        wav = self._preprocess(audio)
        if wav.size == 0:
            raise CoverageFailure("resemblyzer: no speech left after voice-activity trimming")
        return self._encoder.embed_utterance(wav)
