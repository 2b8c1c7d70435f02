"""Offline default MOS: Microsoft DNSMOS (P.835 SIG/BAK/OVRL + P.808) from the speechmos wheel.

`mos` is the P.835 overall score (OVRL), the figure TTS papers quote as "DNSMOS". DNSMOS
was trained on noisy/enhanced speech, not TTS: it tracks noise and distortion well and
naturalness less; the reference-grade MOS scorer is utmosv2.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from orchestrate.api.scoring import Kind, Scorer


class DnsMos(Scorer):
    name: ClassVar[str] = "dnsmos"
    version: ClassVar[str] = "1"
    kind: ClassVar[Kind] = "mos"
    metrics: ClassVar[tuple[str, ...]] = ("mos", "sig_mos", "bak_mos", "p808_mos")
    default: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("speechmos", "onnxruntime", "librosa", "requests")

    def _load(self) -> list[Path]:
        from speechmos import dnsmos

        root = Path(dnsmos.__file__).parent
        primary = root / "dnsmos_models" / "sig_bak_ovr.onnx"
        p808 = root / "dnsmos_models" / "model_v8.onnx"
        # The class, not dnsmos.run(): run() keeps a module-global model and its own paths.
        self._model = dnsmos.DNSMOS(str(primary), str(p808))
        return [primary, p808]

    def _score(self, audio, sample_rate, text, ref):
        # DNSMOS refuses samples outside [-1, 1]; a DAC would clip them the same way, and the
        # integrity scorer counts them. Clips shorter than 9 s are tiled by DNSMOS itself.
        out = self._model(np.clip(audio, -1.0, 1.0), sample_rate, False)
        return {
            "mos": out["ovrl_mos"], "sig_mos": out["sig_mos"],
            "bak_mos": out["bak_mos"], "p808_mos": out["p808_mos"],
        }, {}  # fmt: skip
