"""The Piper engine: piper's own synthesis path, with the onnxruntime session in the engine's
hands and four kinds of named slot a technique may fill.

Slots (each stock default is what `PiperVoice.load(...)` + `PiperVoice.synthesize(text)` do):
  graph     model -> the ONNX graph to run. Stock: the voice's shipped float32 graph (in its
            seedable form, graph.py). A technique may return a quantised copy.
  session   (model, serialized graph) -> onnxruntime.InferenceSession. Stock: piper's
            `InferenceSession(graph, SessionOptions(), ["CPUExecutionProvider"])`, i.e. graph
            optimisation level ORT_ENABLE_ALL, intra/inter-op threads 0 (onnxruntime picks).
  batch     how a prompt's sentences go through the session. Stock: one `session.run` per
            sentence, in order, as `PiperVoice.synthesize` does (it yields one chunk per
            sentence). The graph takes a batch dimension (input_lengths masks the padding),
            so a technique may run several sentences as one padded batch.
  knob.*    knob.length_scale, knob.noise_scale, knob.noise_w: the SynthesisConfig scales
            fed to the graph's `scales` input. Stock: the voice config's `inference` values.

Post-processing is piper's: each sentence's audio divided by its peak (normalize_audio),
clipped to [-1, 1], float32; sentences concatenated back to back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from orchestrate.families.piper import graph as g
from orchestrate.families.piper.model import PiperModel

if TYPE_CHECKING:  # onnx (1.5 s to import) loads when a graph is built, not to list techniques
    import onnx

SLOTS = ("graph", "session", "batch", "knob.*")
KNOBS = ("length_scale", "noise_scale", "noise_w")
# Host noise for the decoder's prior is drawn for this many frames per phoneme id (times the
# length scale); the voices measured here use 2-4. Past it the graph repeats the noise.
FRAMES_PER_ID = 8

GraphSlot = Callable[[PiperModel], "onnx.ModelProto"]
SessionSlot = Callable[[PiperModel, bytes], ort.InferenceSession]


@dataclass
class Sentence:
    """One sentence's graph inputs: its phoneme ids and the host noise drawn for it."""

    ids: list[int]
    noise: list[np.ndarray]  # per NoiseInput: [channels, time] float32
    forced: np.ndarray | None = None  # durations to impose (teacher-forced graphs only)


@dataclass
class Ran:
    """What the batch slot returns: per sentence run, the raw audio (cut to its own length)
    and its durations (frames per phoneme id), plus the seconds spent in `session.run`."""

    audio: list[np.ndarray]
    durations: list[np.ndarray]
    onnx_s: float


BatchSlot = Callable[["Engine", list[Sentence], int, dict[str, np.ndarray]], Ran]


def shipped_graph(model: PiperModel) -> onnx.ModelProto:
    """The voice's shipped float32 graph (seedable form)."""
    return model.seedable


def piper_session(model: PiperModel, graph: bytes) -> ort.InferenceSession:
    """What `PiperVoice.load` builds: default SessionOptions on the CPU provider."""
    return ort.InferenceSession(
        graph, sess_options=ort.SessionOptions(), providers=["CPUExecutionProvider"]
    )


def run_rows(
    engine: Engine, rows: list[Sentence], extra: dict[str, np.ndarray]
) -> tuple[list[np.ndarray], list[np.ndarray], float]:
    """One `session.run` over `rows` (padded to the longest), each row's audio cut to the
    length its durations give; returns (audio, durations, seconds in session.run)."""
    session = engine.session_obj
    width = max(len(r.ids) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r.ids)] = r.ids
    feeds = {
        "input": ids,
        "input_lengths": np.array([len(r.ids) for r in rows], dtype=np.int64),
        **extra,
    }
    for k, spec in enumerate(engine.model.noises):
        t = max(r.noise[k].shape[1] for r in rows)
        feeds[spec.name] = np.stack([_fill(r.noise[k], t) for r in rows])
    if "sid" in extra:
        feeds["sid"] = np.repeat(extra["sid"], len(rows))
    if rows[0].forced is not None:
        forced = np.zeros((len(rows), 1, width), dtype=np.float32)
        for i, r in enumerate(rows):
            forced[i, 0, : len(r.ids)] = r.forced
        feeds[g.FORCED] = forced
    t0 = time.perf_counter()
    out = session.run(engine.outputs, feeds)
    onnx_s = time.perf_counter() - t0
    audio, durations = out[0].reshape(len(rows), -1), out[1].reshape(len(rows), -1)
    hop = engine.model.hop_length
    cut_durations = [  # teacher-forced: the audio follows the imposed durations
        durations[i, : len(r.ids)] if r.forced is None else np.asarray(r.forced, np.float32)
        for i, r in enumerate(rows)
    ]
    cut_audio = [audio[i, : int(d.sum()) * hop] for i, d in enumerate(cut_durations)]
    return cut_audio, cut_durations, onnx_s


def _fill(noise: np.ndarray, t: int) -> np.ndarray:
    """`noise` [C, T0] to [C, t], repeated along time as the graph's Tile would."""
    if noise.shape[1] == t:
        return noise
    return np.tile(noise, (1, -(-t // noise.shape[1])))[:, :t]


def one_at_a_time(
    engine: Engine, sentences: list[Sentence], needed: int, extra: dict[str, np.ndarray]
) -> Ran:
    """Stock: one session.run per sentence, stopping after the first `needed`."""
    audio, durations, onnx_s = [], [], 0.0
    for s in sentences[:needed]:
        a, d, t = run_rows(engine, [s], extra)
        audio += a
        durations += d
        onnx_s += t
    return Ran(audio, durations, onnx_s)


@dataclass
class Engine:
    model: PiperModel
    graph: GraphSlot = shipped_graph
    session: SessionSlot = piper_session
    batch: BatchSlot = one_at_a_time
    knobs: dict[str, float] = field(default_factory=dict)  # knob.<name> -> value
    filled: dict[str, str] = field(default_factory=dict)  # slot -> technique name
    # built by finalize() from the slots:
    graph_proto: onnx.ModelProto | None = None
    session_obj: ort.InferenceSession | None = None
    outputs: list[str] = field(default_factory=lambda: ["output", g.DURATIONS])

    def finalize(self) -> None:
        unknown = sorted(set(self.knobs) - set(KNOBS))
        if unknown:
            raise ValueError(f"unknown piper knob(s) {unknown}; valid: {', '.join(KNOBS)}")
        self.graph_proto = self.graph(self.model)
        self.session_obj = self.session(self.model, self.graph_proto.SerializeToString())

    def scales(self) -> dict[str, float]:
        return {**self.model.default_scales, **self.knobs}

    def feeds(self, voice: str) -> dict[str, np.ndarray]:
        """The inputs every row shares: the scales (and the speaker, if any)."""
        s = self.scales()
        extra = {
            "scales": np.array([s["noise_scale"], s["length_scale"], s["noise_w"]], np.float32)
        }
        sid = self.model.speaker_id(voice)
        if sid is not None:
            extra["sid"] = np.array([sid], dtype=np.int64)
        return extra

    def draw(self, sentences: list[list[int]], seed: int) -> list[Sentence]:
        """Host noise per sentence from (seed, sentence index): the same sentence gets the same
        noise whether it runs alone or in a batch. Drawn [time, channels] and transposed, so
        the first frames' noise does not depend on how many frames were drawn."""
        frames_per_id = FRAMES_PER_ID * max(1.0, self.scales()["length_scale"])
        out = []
        for i, ids in enumerate(sentences):
            rng = np.random.default_rng([seed, i])
            noise = []
            for spec in self.model.noises:
                t = len(ids) if spec.per_phoneme else math.ceil(len(ids) * frames_per_id)
                noise.append(rng.standard_normal((t, spec.channels), dtype=np.float32).T)
            out.append(Sentence(ids, noise))
        return out


def postprocess(raw: list[np.ndarray]) -> np.ndarray:
    """piper's per-sentence normalize_audio (peak to 1.0), clip, float32, concatenated."""
    parts = []
    for audio in raw:
        peak = float(np.max(np.abs(audio))) if audio.size else 0.0
        audio = np.zeros_like(audio) if peak < 1e-8 else audio / peak
        parts.append(np.clip(audio, -1.0, 1.0).astype(np.float32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def stock_engine(model: PiperModel) -> Engine:
    return Engine(model=model)


def sentence_count(ids: list[list[int]], frames: int | None) -> int:
    """How many sentences a length policy asks for: all (None), else whole sentences until
    at least `frames` phoneme ids (at least one; Piper cannot stop mid-sentence)."""
    if frames is None:
        return len(ids)
    total = 0
    for n, s in enumerate(ids, start=1):
        total += len(s)
        if total >= frames:
            return n
    return len(ids)
