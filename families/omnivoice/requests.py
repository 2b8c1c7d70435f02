"""One request's generate() arguments: the operating point of a prompt and its mode
(auto, design with an instruct, clone with a reference and its transcript)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from orchestrate.api.config import SHIPPED_ROOT, OperatingPoint, Workload


def operating_point(workload: Workload, text: str) -> OperatingPoint:
    """The settings of the prompt with this text (the worker passes text only)."""
    for p in workload.prompts:
        if p.text == text and p.point is not None:
            return workload.operating_points[p.point]
    return OperatingPoint()


def request_kwargs(point: OperatingPoint, sample_rate: int) -> dict[str, Any]:
    """generate()'s mode arguments for one operating point; clone needs a transcript."""
    out: dict[str, Any] = {"language": point.language}
    if point.mode == "design":
        if not point.instruct:
            raise ValueError("design mode needs an instruct (e.g. 'female, british accent')")
        out["instruct"] = point.instruct
    elif point.mode == "clone":
        if not point.ref_audio:
            raise ValueError("clone mode needs ref_audio (a WAV file)")
        if not point.ref_text:
            # Without it the package downloads Whisper to transcribe the reference.
            raise ValueError(
                "clone mode needs ref_text, the transcript of ref_audio: without it the "
                "omnivoice package would download a Whisper model to transcribe it"
            )
        out["ref_audio"] = load_reference(point.ref_audio)
        out["ref_text"] = point.ref_text
    return out


def load_reference(path: str) -> tuple[torch.Tensor, int]:
    """(waveform [1, T], sample rate) read with soundfile; relative paths are from the
    shipped configs' root (the checkout, or the installed package).

    Passing a tensor keeps torchaudio's file loaders (and their codec backends) out of it.
    """
    import soundfile as sf

    p = Path(path)
    if not p.is_absolute():
        p = SHIPPED_ROOT / p
    if not p.exists():
        raise FileNotFoundError(f"reference audio {str(p)!r} does not exist")
    data, sr = sf.read(str(p), dtype="float32", always_2d=True)
    return torch.from_numpy(data.mean(axis=1)[None, :].copy()), int(sr)
