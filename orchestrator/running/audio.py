"""Waveform checks and a float32 WAV writer that needs only the standard library.

The GPU worker has no soundfile; float32 WAV keeps the samples as generated (16-bit PCM
would clip and quantise them before the integrity and quality scorers see them). The file
is what the WAVE spec asks of a non-PCM format: an 18-byte fmt chunk (cbSize 0) and a fact
chunk with the sample count, so sox, libsndfile and browsers read it without a warning.
What people listen to is made from it by `reports/listening.py` (16-bit PCM, level set).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

CLIP_LEVEL = 0.999


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    data = np.ascontiguousarray(audio, dtype="<f4").reshape(-1)
    payload = data.tobytes()
    # fmt: format 3 = IEEE float, mono, 32 bits per sample, cbSize 0 (no extension)
    fmt = struct.pack("<HHIIHHH", 3, 1, sample_rate, sample_rate * 4, 4, 32, 0)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    chunks += b"fact" + struct.pack("<II", 4, data.size)  # samples per channel
    chunks += b"data" + struct.pack("<I", len(payload))
    header = b"RIFF" + struct.pack("<I", 4 + len(chunks) + len(payload)) + b"WAVE" + chunks
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(header + payload)
            while view:  # write(2) may write less than asked
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        tmp.replace(path)
    except OSError as exc:
        # A full disk names no file (write(2) has none): name the WAV, and leave no partial.
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def integrity(audio: np.ndarray) -> dict[str, float | bool | int]:
    finite = bool(np.isfinite(audio).all())
    peak = float(np.abs(audio[np.isfinite(audio)]).max()) if audio.size and finite else 0.0
    return {
        "finite": finite,
        "peak_abs": peak,
        "clipped_samples": int((np.abs(np.nan_to_num(audio)) >= CLIP_LEVEL).sum()),
    }
