"""Integrity checks that need no weights: clipping, silence, NaN/inf, duration.

Empty audio raises CoverageFailure (from the base class) instead of scoring: an empty output
is a failed utterance to count, not a quiet one. NaN/inf samples are counted here rather
than refused, so the report can say what was wrong with the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from orchestrate.api.scoring import Kind, Scorer

CLIP_LEVEL = 0.999  # |x| at or above this counts as clipped (float full scale is 1.0)
SILENCE_DBFS = -60.0  # whole-clip RMS below this is "silent"
FLOOR_DBFS = -120.0  # reported instead of -inf for digital silence, so values stay finite


class Integrity(Scorer):
    name: ClassVar[str] = "integrity"
    version: ClassVar[str] = "1"
    kind: ClassVar[Kind] = "integrity"
    metrics: ClassVar[tuple[str, ...]] = (
        "clipped_samples", "clipped_fraction", "nonfinite_samples",
        "rms_dbfs", "silent", "duration_s",
    )  # fmt: skip
    default: ClassVar[bool] = True
    sample_rate: ClassVar[int | None] = None  # judged at the rate it was written
    accepts_nonfinite: ClassVar[bool] = True

    def _load(self) -> list[Path]:
        return []

    def _score(self, audio, sample_rate, text, ref):
        finite = np.isfinite(audio)
        x = audio[finite].astype(np.float64)
        clipped = int((np.abs(x) >= CLIP_LEVEL).sum())
        rms = float(np.sqrt(np.mean(x**2))) if x.size else 0.0
        dbfs = max(FLOOR_DBFS, 20 * np.log10(rms)) if rms > 0 else FLOOR_DBFS
        return {
            "clipped_samples": clipped,
            "clipped_fraction": clipped / audio.size,
            "nonfinite_samples": int(audio.size - finite.sum()),
            "rms_dbfs": dbfs,
            "silent": float(dbfs < SILENCE_DBFS),
            "duration_s": audio.size / sample_rate,
        }, {}
