"""Programmatic dependent launch (PDL) for every Triton kernel of the stack (Hopper only).

At batch 1 a decode step is a chain of short kernels, and each one normally waits for the
previous grid to finish, drain and be torn down before its own blocks start. With PDL
(Triton's `launch_pdl=True`, the CUDA launch attribute programmaticStreamSerialization) a
kernel may be scheduled while its predecessor still runs: everything before its
`tl.extra.cuda.gdc_wait()` (index maths, and in the GEMVs and LayerNorm the loads of
immutable weights) overlaps the predecessor's tail, and the predecessor's
`gdc_launch_dependents()` releases it early. Each kernel waits before it reads anything an
earlier kernel wrote, so results are unchanged: exact. Inside a CUDA graph the dependency
becomes a programmatic edge, so it also pays under cuda_graph / graph_loop.

This technique fills the `launch` slot and nothing else: engine.launch.pdl, which every
kernel-calling part (projections, attention, sampler, the fused decoder) reads at each
launch. It needs an sm_90 GPU and is refused or skipped elsewhere with that reason; an
engine where no kernel technique filled a slot is an error, never a silent no-op. (Those
techniques also take `pdl: true` for their own kernels alone.)
"""

from __future__ import annotations

import dataclasses

from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.rumik.engine import Engine

# Techniques whose Triton kernels take launch_pdl.
KERNEL_TECHNIQUES = (
    "int8_projections",
    "int6_projections",
    "decode_attention",
    "device_sampler",
    "fused_rope_norm",
)


class PDL(Technique):
    name = "pdl"
    family = "rumik"
    exact = True
    slots = ("launch",)
    requires = ("cuda", "sm90", "package:triton")
    summary = "Programmatic dependent launch for the stack's Triton kernels (Hopper)."

    @classmethod
    def check_stack(
        cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]
    ) -> str | None:
        if not any(name in earlier for name in KERNEL_TECHNIQUES):
            return (
                "no Triton kernel technique comes before it to switch on (one of "
                f"{', '.join(KERNEL_TECHNIQUES)})"
            )
        return None

    def apply(self, engine: Engine) -> None:
        # engine.filled says which technique fills each slot so far: one of them must own
        # kernels, or the option would reach nothing.
        if set(engine.filled.values()).isdisjoint(KERNEL_TECHNIQUES):
            raise RuntimeError("pdl: no part of this engine launches Triton kernels")
        engine.launch = dataclasses.replace(engine.launch, pdl=True)
