"""Fidelity for an audio model without next-token logits: each engine's waveform against
stock's, same text, same seed (so the same host noise, graph.py).

Piper's only discrete decisions are its durations (frames per phoneme id, w_ceil). A stack
that moves one duration shifts every later sample, and a sample-by-sample comparison would
then measure the shift, not the sound. So, as the Rumik family teacher-forces tokens:
  1. free-running, the stack's durations are compared with stock's, id by id;
  2. teacher-forced on stock's durations (graph.teacher_forced), the stack's waveform is
     compared with stock's sample by sample: max |difference|, SNR in dB, and a spectral
     KL (per STFT frame, the power spectrum as a distribution over frequency bins).

FidelityRecord was written for logits; its fields carry (tolerance and noise floor in the
same units as the difference):
  steps                phoneme ids compared (every id of the first prompt; `steps` unused)
  max_abs_logit_diff   max |stack - stock| over the teacher-forced waveform (peak-normalised
                       audio, as piper writes it)
  mean_kl, max_kl      spectral KL(stock || stack), mean and max over STFT frames
  top1_agreement       fraction of phoneme ids whose duration equals stock's
  topk_agreement       fraction whose duration is within one frame of stock's
  within_tolerance     max |diff| <= tolerance and every duration equal
  noise_floor_*        stock against stock at the next seed (teacher-forced): how far the
                       audio moves when only the noise draw changes
  support_*            None (no restricted head)
The SNR has no field; `compare` returns it (tests and `orchestrate`'s README use it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from orchestrate.api.records import FidelityRecord
from orchestrate.families.piper import graph as g
from orchestrate.families.piper.engine import SLOTS, Engine, postprocess, stock_engine
from orchestrate.families.piper.model import PiperModel

# float32 graphs that differ only in kernel choice or summation order agree to ~1e-6 of
# full scale; 1e-4 (-80 dB) is float tolerance for peak-normalised audio.
TOLERANCE = 1e-4
N_FFT, HOP = 1024, 256


@dataclass
class Rendered:
    audio: np.ndarray  # post-processed, sentences concatenated
    durations: np.ndarray  # every phoneme id's frames, sentences concatenated
    per_sentence: list[np.ndarray]  # durations per sentence (to force another engine)


@dataclass
class Comparison:
    ids: int
    max_abs: float
    snr_db: float
    mean_kl: float
    max_kl: float
    same_durations: float
    durations_within_one: float
    free_samples: tuple[int, int]  # (stock, stack) lengths free-running


def forced_engine(engine: Engine) -> Engine:
    """`engine` on its teacher-forced graph (a new session over graph.teacher_forced)."""
    proto = g.teacher_forced(engine.graph_proto)
    session = engine.session(engine.model, proto.SerializeToString())
    return dataclasses.replace(engine, session_obj=session)


def render(
    engine: Engine, text: str, seed: int, voice: str, forced: list[np.ndarray] | None = None
) -> Rendered:
    """The engine's synthesis of `text` (every sentence, through its batch slot); with
    `forced` (an engine from `forced_engine`), on those durations."""
    sentences = engine.draw(engine.model.sentences(text), seed)
    for s, d in zip(sentences, forced or [None] * len(sentences), strict=True):
        s.forced = d
    ran = engine.batch(engine, sentences, len(sentences), engine.feeds(voice))
    return Rendered(postprocess(ran.audio), np.concatenate(ran.durations), ran.durations)


def spectral_kl(ref: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(ref || other) per STFT frame, each frame's power spectrum normalised to sum 1."""

    def power(x: np.ndarray) -> np.ndarray:
        frames = 1 + max(0, len(x) - N_FFT) // HOP
        idx = np.arange(N_FFT)[None, :] + HOP * np.arange(frames)[:, None]
        padded = np.pad(x, (0, max(0, idx.max() + 1 - len(x))))
        return np.abs(np.fft.rfft(padded[idx] * np.hanning(N_FFT), axis=1)) ** 2

    p, q = power(ref.astype(np.float64)), power(other.astype(np.float64))
    eps = 1e-10 * max(float(p.max()), 1e-30)  # a floor: silence frames compare as flat
    p, q = p + eps, q + eps
    p, q = p / p.sum(1, keepdims=True), q / q.sum(1, keepdims=True)
    return np.sum(p * np.log(p / q), axis=1)


def compare(stock: Engine, engine: Engine, text: str, seed: int, voice: str) -> Comparison:
    """`engine` against `stock` on `text` and `seed` (both finalized)."""
    ref = render(stock, text, seed, voice)
    return measure(ref, *_renders(engine, ref, text, seed, voice))


def _renders(
    engine: Engine, ref: Rendered, text: str, seed: int, voice: str
) -> tuple[Rendered, Rendered]:
    """(teacher-forced, free-running) renders; where the free-running durations already
    equal stock's, the free render is the teacher-forced one (no second session)."""
    free = render(engine, text, seed, voice)
    if np.array_equal(free.durations, ref.durations):
        return free, free
    return render(forced_engine(engine), text, seed, voice, ref.per_sentence), free


def measure(ref: Rendered, forced: Rendered, free: Rendered) -> Comparison:
    """`forced` (teacher-forced on `ref`'s durations) and `free` (free-running) against
    `ref`: the waveform on the first, the durations on the second."""
    diff = forced.audio.astype(np.float64) - ref.audio
    err = float(np.sum(diff**2))
    snr = (
        float("inf")
        if err == 0
        else 10 * np.log10(float(np.sum(ref.audio.astype(np.float64) ** 2)) / err)
    )
    kl = spectral_kl(ref.audio, forced.audio)
    d = np.abs(free.durations - ref.durations)
    return Comparison(
        ids=int(ref.durations.size),
        max_abs=float(np.max(np.abs(diff))) if diff.size else 0.0,
        snr_db=snr,
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        same_durations=float(np.mean(d == 0)),
        durations_within_one=float(np.mean(d <= 1)),
        free_samples=(len(ref.audio), len(free.audio)),
    )


def against_stock(
    model: PiperModel, engines: dict[str, Engine], text: str, seed: int, voice: str
) -> dict[str, FidelityRecord]:
    """A FidelityRecord per engine, against a fresh stock engine (see the module docstring)."""
    stock = stock_engine(model)
    stock.finalize()
    ref = render(stock, text, seed, voice)
    floor = render(forced_engine(stock), text, seed + 1, voice, ref.per_sentence)
    floor_cmp = measure(ref, floor, ref)
    out = {}
    for name, engine in engines.items():
        c = measure(ref, *_renders(engine, ref, text, seed, voice))
        out[name] = FidelityRecord(
            steps=c.ids,
            max_abs_logit_diff=c.max_abs,
            mean_kl=c.mean_kl,
            max_kl=c.max_kl,
            top1_agreement=c.same_durations,
            topk_agreement=c.durations_within_one,
            within_tolerance=c.max_abs <= TOLERANCE and c.same_durations == 1.0,
            tolerance=TOLERANCE,
            noise_floor_max_abs=floor_cmp.max_abs,
            noise_floor_kl=floor_cmp.mean_kl,
            covers=list(SLOTS),  # the whole synthesis runs: every slot and knob
        )
    return out
