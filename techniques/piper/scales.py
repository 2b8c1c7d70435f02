"""Piper's synthesis scales as techniques, one knob slot each (`knob.<name>`): the
SynthesisConfig values fed to the graph's `scales` input.

- length_scale multiplies every phoneme's duration: below 1 speech is faster and shorter,
  and the decoder (most of the cost) runs over fewer frames. Latency falls about in
  proportion; real-time factor hardly moves (less audio for less work), and words blur as
  it drops.
- noise_scale scales the prior noise the flow turns into the voice's latent (voice
  variation; 0: the prior's mean), noise_w the duration predictor's noise (rhythm
  variation). Neither changes the work done: they exist to move quality, e.g. so the
  protocol has a real degradation to reject (experiments/piper-degraded.yaml).

None is exact: each changes the audio (fidelity shows how: durations for length_scale,
the teacher-forced waveform for the noise scales).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams


class _Knob(Technique):
    """Sets the engine's scale named like the technique; claims `knob.<name>`."""

    family = "piper"
    exact = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.slots = (f"knob.{cls.name}",)

    def apply(self, engine: Any) -> None:
        engine.knobs[self.name] = float(self.params.value)  # type: ignore[attr-defined]


class LengthScaleParams(TechniqueParams):
    value: float = Field(0.85, gt=0, le=4, description="Duration multiplier (voice: 1.0).")


class LengthScale(_Knob):
    name = "length_scale"
    summary = "phoneme duration multiplier (< 1: faster speech, fewer frames to decode)"
    Params = LengthScaleParams


class NoiseScaleParams(TechniqueParams):
    value: float = Field(0.667, ge=0, le=4, description="Prior noise scale (voice: 0.667).")


class NoiseScale(_Knob):
    name = "noise_scale"
    summary = "prior noise scale (voice variation; no speed effect)"
    Params = NoiseScaleParams


class NoiseWParams(TechniqueParams):
    value: float = Field(0.8, ge=0, le=4, description="Duration noise scale (voice: 0.8).")


class NoiseW(_Knob):
    name = "noise_w"
    summary = "duration predictor noise scale (rhythm variation; no speed effect)"
    Params = NoiseWParams
