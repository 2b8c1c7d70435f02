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

This technique fills no slot: it switches PDL on in the kernel-using parts the earlier
techniques installed (projections, attention, sampler, the fused decoder). It needs an sm_90
GPU and is refused or skipped elsewhere with that reason; a stack with nothing to switch on
is an error, never a silent no-op. (Those techniques also take `pdl: true` one by one.)
"""

from __future__ import annotations

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
        switched = []
        for slot in ("projections", "attention", "sampler"):
            part = getattr(engine, slot)
            if hasattr(part, "pdl"):
                part.pdl = True
                switched.append(engine.filled.get(slot, slot))
        from orchestrate.techniques.rumik.fused_rope_norm import FusedRopeNormDecoder

        if engine.notes.get("static_decoder_cls") is FusedRopeNormDecoder:
            switched.append("fused_rope_norm")
        engine.notes["pdl"] = True  # read by the fused decoder when it is built
        if not switched:
            raise RuntimeError("pdl: no part of this engine launches Triton kernels")
        engine.notes["pdl_switched"] = switched
