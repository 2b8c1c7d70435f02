"""onnxruntime session settings: graph optimisation level and thread pools.

Stock is what `PiperVoice.load` builds: `SessionOptions()` defaults (ORT_ENABLE_ALL, intra-
and inter-op threads 0 = onnxruntime's choice, one intra-op thread per physical core,
spinning while idle). Whether fewer threads help depends on the machine, not the model:
on a 2-core CPU shared with other jobs (load ~4) one intra-op thread measured 1.24-1.53x
stock (the second thread mostly spin-waits for a core), on the same CPU idle 0.70x. The
optimisation level moved nothing measurable (basic/extended/all within the noise).

Exact within float tolerance: neither the level nor the thread count changes the durations;
`disable`/`basic` pick other kernels than `all` (max |diff| ~4e-5 of full scale on the joe
voice, SNR ~97 dB); thread counts at level `all` are bitwise identical there.
"""

from __future__ import annotations

from typing import Literal

import onnxruntime as ort
from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.piper.engine import Engine
from orchestrate.families.piper.model import PiperModel

LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class OrtSessionParams(TechniqueParams):
    level: Literal["disable", "basic", "extended", "all"] = Field(
        "all", description="Graph optimisation level (stock: all)."
    )
    intra_op_threads: int = Field(
        1, ge=0, description="Threads inside one op (stock 0: one per physical core)."
    )
    inter_op_threads: int = Field(
        0, ge=0, description="Threads across independent ops (parallel execution mode only)."
    )
    parallel: bool = Field(False, description="ORT_PARALLEL execution mode (stock: sequential).")
    spinning: bool = Field(
        True, description="Let idle intra-op threads spin (stock: yes); off frees the core."
    )


class SessionFactory:
    """Builds the engine's InferenceSession with these options (CPU provider, as piper)."""

    def __init__(self, params: OrtSessionParams):
        self.params = params

    def __call__(self, model: PiperModel, graph: bytes) -> ort.InferenceSession:
        p = self.params
        options = ort.SessionOptions()
        options.graph_optimization_level = LEVELS[p.level]
        options.intra_op_num_threads = p.intra_op_threads
        options.inter_op_num_threads = p.inter_op_threads
        if p.parallel:
            options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if p.spinning else "0"
        )
        return ort.InferenceSession(graph, sess_options=options, providers=["CPUExecutionProvider"])


class OrtSession(Technique):
    name = "ort_session"
    family = "piper"
    exact = True
    slots = ("session",)
    summary = "onnxruntime optimisation level and intra/inter-op threads (stock: all, 0, 0)"
    Params = OrtSessionParams

    def apply(self, engine: Engine) -> None:
        engine.session = SessionFactory(self.params)  # type: ignore[arg-type]
