"""Reference MOS: UTMOSv2 (fusion_stage3), averaged over the fold checkpoints found locally.

Weights: fold checkpoints `fold{k}_s42_best_model.pth` in $ORCHESTRATE_UTMOSV2_DIR, else in
utmosv2's own cache ($UTMOSV2_CHACHE or ~/.cache/utmosv2)/models/fusion_stage3. The model
also builds facebook/wav2vec2-base and the timm backbone tf_efficientnetv2_s.in21k_ft_in1k
from the Hugging Face cache; each must already be cached, because utmosv2 would otherwise
download them (and its checkpoints) at run time. UTMOSv2 predictions vary with the random
frames drawn, so each fold averages `repetitions` draws (the paper: 5 folds x 5).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

from orchestrate.api.scoring import Kind, Scorer, ScorerUnavailable

CONFIG = "fusion_stage3"
ENV_VAR = "ORCHESTRATE_UTMOSV2_DIR"
CACHED_REPOS = ("facebook/wav2vec2-base", "timm/tf_efficientnetv2_s.in21k_ft_in1k")


def checkpoint_dir() -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    cache = Path(os.environ.get("UTMOSV2_CHACHE", "~/.cache/utmosv2")).expanduser()
    return cache / "models" / CONFIG


class UtmosV2(Scorer):
    name: ClassVar[str] = "utmosv2"
    version: ClassVar[str] = "1"
    kind: ClassVar[Kind] = "mos"
    metrics: ClassVar[tuple[str, ...]] = ("mos", "mos_fold_std")
    reference: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("utmosv2|hyperion-utmosv2", "timm")

    def __init__(self, repetitions: int = 5) -> None:
        super().__init__()
        self.repetitions = repetitions

    def _load(self) -> list[Path]:
        ckpts = sorted(checkpoint_dir().glob("fold*_s42_best_model.pth"))
        if not ckpts:
            raise ScorerUnavailable(f"no UTMOSv2 fold checkpoints in {checkpoint_dir()}")
        from huggingface_hub import snapshot_download

        for repo in CACHED_REPOS:
            try:
                snapshot_download(repo, local_files_only=True)
            except Exception as e:
                raise ScorerUnavailable(f"{repo} is not in the Hugging Face cache") from e
        import torch
        import utmosv2

        self._device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self._models = [
            utmosv2.create_model(
                pretrained=True, config=CONFIG, checkpoint_path=p, device=self._device
            ).eval()
            for p in ckpts
        ]
        return ckpts

    def _score(self, audio, sample_rate, text, ref):
        import numpy as np

        per_fold = [
            float(m.predict(data=audio, sr=sample_rate, device=self._device,
                            num_repetitions=self.repetitions, verbose=False))
            for m in self._models
        ]  # fmt: skip
        return {"mos": float(np.mean(per_fold)), "mos_fold_std": float(np.std(per_fold))}, {}
