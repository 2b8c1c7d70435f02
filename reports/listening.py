"""Recordings made fit to listen to on a report page, saying what was done to them.

A worker's WAVs keep the samples as generated (float32, any level: random weights give
clips peaking at tens of times full scale). Embedded as they are, they play as clipped noise
while the table reads `valid`. A page clip is instead:
- written by soundfile (libsndfile) as 16-bit PCM, what every player reads;
- level-set for listening: scaled to an RMS of `TARGET_RMS_DBFS`, less where that would put
  its peak above `PEAK_CEILING_DBFS` (an RMS level, not a LUFS loudness measurement);
- flagged when the generated samples reached full scale (`CLIP_LEVEL`) or were not finite,
  since the scaling hides that;
- drawn as a spectrogram of the level-set audio.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrate.reports.embed import new_figure, png_base64
from orchestrate.running.audio import CLIP_LEVEL

TARGET_RMS_DBFS = -20.0
PEAK_CEILING_DBFS = -1.0
LEVEL_NOTE = (
    f"Clips are 16-bit PCM, each scaled to an RMS of {TARGET_RMS_DBFS:g} dBFS (capped so its "
    f"peak stays at or below {PEAK_CEILING_DBFS:g} dBFS) for listening; the gain beside each "
    "says how much. Clipping is flagged on the samples as generated."
)


@dataclass
class ListeningClip:
    wav_base64: str  # 16-bit PCM WAV, level-set
    spectrogram_png: str  # base64 PNG
    seconds: float
    source_peak: float  # max |sample| as generated (1.0 = full scale)
    clipped_samples: int  # as generated, at or beyond full scale
    non_finite: int  # NaN or inf samples as generated (set to 0 here)
    gain_db: float

    @property
    def flags(self) -> list[str]:
        out = []
        if self.non_finite:
            out.append(f"{self.non_finite} non-finite samples (played as silence)")
        if self.clipped_samples:
            out.append(
                f"clipped as generated: {self.clipped_samples} samples at or beyond full "
                f"scale (peak {self.source_peak:.3g}x)"
            )
        if self.source_peak == 0.0:
            out.append("silent")
        return out


class UnreadableClip(ValueError):
    """A recording libsndfile cannot read (truncated, not audio): the page says so."""


def listening_clip(path: Path) -> ListeningClip:
    """Read one recording (any format libsndfile reads) and make its page clip."""
    import soundfile as sf

    try:
        audio, rate = sf.read(path, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as exc:  # RuntimeError: older soundfile
        raise UnreadableClip(f"{path.name}: not a readable recording ({exc})") from exc
    mono = audio.mean(axis=1)
    finite = np.isfinite(mono)
    mono = np.where(finite, mono, 0.0).astype(np.float32)
    peak = float(np.abs(mono).max()) if mono.size else 0.0
    gain = _gain(mono, peak)
    level_set = np.clip(mono * gain, -1.0, 1.0)
    buf = io.BytesIO()
    sf.write(buf, level_set, rate, format="WAV", subtype="PCM_16")
    return ListeningClip(
        wav_base64=base64.b64encode(buf.getvalue()).decode("ascii"),
        spectrogram_png=_spectrogram(level_set, rate),
        seconds=mono.size / rate,
        source_peak=peak,
        clipped_samples=int((np.abs(mono) >= CLIP_LEVEL).sum()),
        non_finite=int((~finite).sum()),
        gain_db=20 * float(np.log10(gain)),
    )


def _gain(mono: np.ndarray, peak: float) -> float:
    rms = float(np.sqrt(np.mean(np.square(mono, dtype=np.float64)))) if mono.size else 0.0
    if rms == 0.0 or peak == 0.0:
        return 1.0  # silence stays silence
    return min(10 ** (TARGET_RMS_DBFS / 20) / rms, 10 ** (PEAK_CEILING_DBFS / 20) / peak)


def _spectrogram(audio: np.ndarray, rate: int) -> str:
    fig, ax = new_figure((3.2, 1.3))
    if audio.size >= 256:
        # a fixed dither at -100 dBFS: a silent stretch would otherwise be log(0)
        dither = 1e-5 * np.random.default_rng(0).standard_normal(audio.size)
        *_, image = ax.specgram(audio + dither, NFFT=256, Fs=rate, noverlap=128, cmap="magma")
        top = float(image.get_array().max())
        image.set_clim(top - 100, top)  # 100 dB of range below the loudest bin
    ax.set_xlabel("s", fontsize=6, labelpad=0)
    ax.set_ylabel("Hz", fontsize=6, labelpad=0)
    ax.tick_params(labelsize=5, pad=1)
    return png_base64(fig, dpi=90, pad=0.2)
