"""Optional MOS: DistillMOS (weights in the distillmos wheel).

Not the offline default: `import distillmos` imports torchaudio, and PyPI's torchaudio wheels
are CUDA builds pinned to one torch release, so beside a CPU torch (or a newer torch) the
import fails and this scorer reports ScorerUnavailable with that reason. Where a matching
torchaudio loads, it works: `pip install distillmos`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from orchestrate.api.scoring import Kind, Scorer, ScorerUnavailable


class DistillMos(Scorer):
    name: ClassVar[str] = "distillmos"
    version: ClassVar[str] = "1"
    kind: ClassVar[Kind] = "mos"
    metrics: ClassVar[tuple[str, ...]] = ("mos",)
    requires: ClassVar[tuple[str, ...]] = ("distillmos", "torchaudio")

    def _load(self) -> list[Path]:
        try:
            import distillmos
            from distillmos.sqa import DEFAULT_WEIGHTS_CHKPT
        except (ImportError, OSError) as e:
            raise ScorerUnavailable(
                f"distillmos imports torchaudio, which does not load beside this torch "
                f"({type(e).__name__}: {e})"
            ) from e
        import torch

        self._torch = torch
        self._model = distillmos.ConvTransformerSQAModel().eval()  # loads the v7 weights
        return [Path(DEFAULT_WEIGHTS_CHKPT)]

    def _score(self, audio, sample_rate, text, ref):
        with self._torch.inference_mode():
            mos = self._model(self._torch.from_numpy(audio)[None])
        return {"mos": float(mos.reshape(-1)[0])}, {}
