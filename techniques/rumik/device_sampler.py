"""Fused on-device top-k sampler (Triton): no host synchronisation per token.

APPROXIMATE in the issue's sense: it draws from exactly stock's distribution (temperature,
top-k over the allowed columns; a statistical test checks it) but from a different random
stream, so the same seed gives other tokens than stock. One or two launches instead of the
mask build, topk, softmax and multinomial, and the random counter lives on the device, so
the sampler can sit inside a captured graph.
"""

from __future__ import annotations

import torch
from pydantic import Field

from orchestrate.api.config import SamplingConfig
from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.rumik.engine import Engine, HeadLogits

KERNEL_SEED = 0x5EED  # the per-utterance seed goes into the counter, which lives on the device


class DeviceSamplerParams(TechniqueParams):
    pdl: bool = Field(False, description="Programmatic dependent launch (Hopper).")


class DeviceSampler:
    def __init__(self, engine: Engine, pdl: bool):
        self.counter = torch.zeros(1, dtype=torch.long, device=engine.model.device)
        self.seed: int | None = None
        self.engine = engine  # its `launch` option is read at each kernel call
        self.pdl = pdl  # this technique's own `pdl` param; engine.launch.pdl adds the rest

    def reset(self, seed: int) -> None:
        """Start the utterance's random stream: (seed, draw) -> one Philox counter value."""
        self.counter.fill_(seed << 32)
        self.seed = seed

    def __call__(
        self,
        head: HeadLogits,
        *,
        allow_end: bool,
        force_end: bool,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> torch.Tensor:
        from orchestrate.techniques.rumik.kernels.sampler import sample_top_k

        if sampling.top_p < 1.0:
            raise ValueError("device_sampler supports top_p = 1.0 only")
        if self.seed is None:  # loops call reset() at each utterance's start
            self.reset(generator.initial_seed())
        ids = head.column_ids
        if force_end:
            end = torch.full((1,), head.end_column, dtype=torch.long, device=self.counter.device)
            return (end if ids is None else ids[end]).view(1, 1)
        units = head.unit_columns
        if not isinstance(units, slice):
            raise TypeError("device_sampler needs the unit columns as one contiguous range")
        col = sample_top_k(
            head.logits[0],
            self.counter,
            seed=KERNEL_SEED,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            allowed=(units.start, units.stop),
            extra_allowed=head.end_column if allow_end else None,
            launch_pdl=self.pdl or self.engine.launch.pdl,
        )
        return (col if ids is None else ids[col]).view(1, 1)


class DeviceSamplerTechnique(Technique):
    name = "device_sampler"
    family = "rumik"
    exact = False
    slots = ("sampler",)
    requires = ("cuda", "package:triton")
    summary = "APPROXIMATE (other random stream): fused top-k sampler, no host sync."
    Params = DeviceSamplerParams

    def apply(self, engine: Engine) -> None:
        engine.sampler = DeviceSampler(engine, self.params.pdl)  # type: ignore[attr-defined]
