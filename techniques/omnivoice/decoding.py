"""The package's decoding knobs as techniques: each sets one OmniVoiceGenerationConfig field.

All change what is generated (fewer steps, other guidance or schedules), so none is exact;
fidelity against stock shows by how much. Values are checked by the engine's knob
validation too (e.g. num_step >= 1), so a bad value fails at engine build, by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams


class _Knob(Technique):
    """Sets the OmniVoiceGenerationConfig field named like the technique; claims the slot
    `knob.<name>` (confidence_parallel claims knob.num_step too: it sets the step limit)."""

    family = "omnivoice"
    exact = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.slots = (f"knob.{cls.name}",)

    def apply(self, engine: Any) -> None:
        engine.knobs[self.name] = self.params.value  # type: ignore[attr-defined]
        engine.config()  # validate now, naming the knob


class NumStepParams(TechniqueParams):
    value: int = Field(
        16,
        ge=1,
        description="Unmasking steps (package default 32).",
        json_schema_extra={"search": [4, 32]},  # the `params` proposer's range
    )


class NumStep(_Knob):
    name = "num_step"
    summary = "unmasking steps (default 32; the docs suggest 16 for speed)"
    Params = NumStepParams


class GuidanceScaleParams(TechniqueParams):
    value: float = Field(
        2.0,
        ge=0,
        description="CFG scale (package default 2.0).",
        json_schema_extra={"search": [0.0, 4.0]},
    )


class GuidanceScale(_Knob):
    name = "guidance_scale"
    summary = "classifier-free guidance scale (0 still computes the unconditioned rows)"
    Params = GuidanceScaleParams


class TShiftParams(TechniqueParams):
    value: float = Field(
        0.1,
        gt=0,
        description="Time-step shift (package default 0.1).",
        json_schema_extra={"search": [0.05, 1.0]},
    )


class TShift(_Knob):
    name = "t_shift"
    summary = "time-step shift of the unmasking schedule"
    Params = TShiftParams


class PositionTemperatureParams(TechniqueParams):
    value: float = Field(5.0, ge=0, description="Gumbel temperature of position choice.")


class PositionTemperature(_Knob):
    name = "position_temperature"
    summary = "temperature of which positions unmask (0: deterministic; hurt long-form)"
    Params = PositionTemperatureParams


class LayerPenaltyFactorParams(TechniqueParams):
    value: float = Field(5.0, description="Penalty per codebook index (package default 5.0).")


class LayerPenaltyFactor(_Knob):
    name = "layer_penalty_factor"
    summary = "how strongly earlier codebooks unmask first"
    Params = LayerPenaltyFactorParams
