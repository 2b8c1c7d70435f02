"""What a queued job needs and what a pool worker offers: the vocabulary of scheduling.

A job's `Requirements` are derived from its plan (`requirements_of`): its family, device,
whether a technique needs a Hopper GPU, and, when the submitter asks, a minimum GPU memory
or one GPU model (a comparison with earlier records needs the same hardware). A worker
describes itself once, at start (`Capabilities.probe`), and claims only jobs `why_not`
finds nothing against; a job no live worker can run stays pending with that reason.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrate.api.records import SCHEMA_VERSION, JobSpec

JOB_STATES = ("PENDING", "RUNNING", "DONE", "FAILED", "CANCELLED")
FINAL_STATES = ("DONE", "FAILED", "CANCELLED")
# A worker killed mid-job (kill -9, the OOM killer, a lost host) gives its job back this
# many times in all before the job fails with the attempts listed.
DEFAULT_MAX_ATTEMPTS = 3


class Requirements(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str
    device: Literal["cpu", "cuda"]
    sm90: bool = Field(False, description="A technique of the job needs a Hopper GPU.")
    min_gpu_memory_gb: float | None = Field(None, gt=0)
    gpu_model: str | None = Field(None, description="Substring of the GPU's name, e.g. H200.")
    schema_version: int = SCHEMA_VERSION


class Capabilities(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: Literal["cpu", "cuda"]
    gpu_name: str | None = None
    gpu_memory_gb: float | None = None
    capability: tuple[int, int] | None = None
    families: tuple[str, ...] = ()
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def probe(cls, device: Literal["cpu", "cuda"], families: tuple[str, ...]) -> Capabilities:
        """This process's device (a pool worker sees one GPU: CUDA_VISIBLE_DEVICES)."""
        if device == "cuda":
            import torch  # here: the queue's commands need no torch (3 s an import)

            if not torch.cuda.is_available():
                raise RuntimeError("a CUDA worker was asked for, but no CUDA device is visible")
            props = torch.cuda.get_device_properties(0)
            return cls(
                device="cuda",
                gpu_name=props.name,
                gpu_memory_gb=props.total_memory / 1e9,
                capability=(props.major, props.minor),
                families=families,
            )
        return cls(device="cpu", families=families)

    def label(self) -> str:
        if self.device == "cpu":
            return "cpu"
        return f"{self.gpu_name} ({self.gpu_memory_gb:.0f} GB)"


def requirements_of(
    job: JobSpec,
    requires: dict[str, tuple[str, ...]],
    *,
    min_gpu_memory_gb: float | None = None,
    gpu_model: str | None = None,
) -> Requirements:
    """`requires`: each technique's declared requirements (Technique.requires), by name."""
    names = {t.name for s in job.stacks for t in s.techniques}
    return Requirements(
        family=job.model.family,
        device="cuda" if job.model.device == "cuda" else "cpu",
        sm90=any("sm90" in requires.get(n, ()) for n in names),
        min_gpu_memory_gb=min_gpu_memory_gb,
        gpu_model=gpu_model,
        schema_version=job.schema_version,
    )


def why_not(req: Requirements, caps: Capabilities) -> str | None:
    """None when a worker with `caps` can run a job needing `req`, else one reason."""
    if req.schema_version > caps.schema_version:
        return (
            f"job schema version {req.schema_version} is newer than this worker's "
            f"{caps.schema_version} (upgrade orchestrate on the worker)"
        )
    if caps.families and req.family not in caps.families:
        return f"family {req.family!r} is not installed on the worker"
    if req.device != caps.device:
        return f"needs a {req.device} worker"
    if req.sm90 and (caps.capability is None or caps.capability < (9, 0)):
        return "needs a Hopper GPU (sm_90)"
    if req.min_gpu_memory_gb and (caps.gpu_memory_gb or 0) < req.min_gpu_memory_gb:
        return f"needs {req.min_gpu_memory_gb:g} GB of GPU memory"
    if req.gpu_model and req.gpu_model.lower() not in (caps.gpu_name or "").lower():
        return f"needs a {req.gpu_model} GPU"
    return None
