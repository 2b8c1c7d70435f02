"""Config -> plan: validate every stack up front and produce a serialisable job.

Validation here is static (names, family, params, conflicts, order), so a bad stack fails
before any model is built or GPU time is spent. Device requirements are checked again by
the worker, on the device that will run them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from orchestrator.config import ModelSpec, Protocol, StackSpec, Workload
from orchestrator.environment import git_state
from orchestrator.records import JobSpec
from orchestrator.registry import StackError, build_stack, discover
from orchestrator.technique import DeviceCaps


def plan_job(
    model: ModelSpec,
    workload: Workload,
    stacks: list[StackSpec],
    protocol: Protocol,
    output_root: Path,
    strict: bool = False,
    fidelity_steps: int = 32,
    check_device: bool = True,
) -> JobSpec:
    names = [s.name for s in stacks]
    if len(set(names)) != len(names):
        raise StackError(f"the same stack is listed twice: {names}")
    caps = DeviceCaps.probe(model.device) if check_device else None
    if check_device and model.device == "cuda" and caps and caps.kind != "cuda":
        raise StackError("--device cuda was asked for, but no CUDA device is visible here")
    for stack in stacks:
        if stack.family != model.family:
            raise StackError(
                f"stack {stack.name!r} is for {stack.family!r}; model is {model.family!r}"
            )
        build_stack(stack, caps, strict=strict)  # raises on anything invalid
    sha, _ = git_state()
    job = JobSpec(
        model=model,
        workload=workload,
        stacks=stacks,
        protocol=protocol,
        strict=strict,
        fidelity_steps=fidelity_steps,
        output_dir="",
        code_sha=sha,
    )
    return job.model_copy(update={"output_dir": str(output_root / job.job_id)})


def prefix_stack(spec: StackSpec, n: int) -> StackSpec:
    """The first `n` techniques of `spec`, as a stack of its own (`NAME-pN`)."""
    return spec.model_copy(
        update={
            "name": f"{spec.name}-p{n}",
            "description": f"first {n} techniques of {spec.name}",
            "techniques": spec.techniques[:n],
        }
    )


def identity(job: JobSpec) -> str:
    """What makes two runs the same experiment: model, workload, stacks with technique
    versions, protocol and code. A repeated identity is not re-run unless forced."""
    known = discover()  # a result from a host with other plugins still gets an identity
    stacks = [
        {
            "spec": s.model_dump(mode="json"),
            "versions": {
                t.name: known[t.name].version if t.name in known else None for t in s.techniques
            },
        }
        for s in job.stacks
    ]
    blob = json.dumps(
        {
            "model": job.model.model_dump(mode="json"),
            "workload": job.workload.model_dump(mode="json"),
            "stacks": stacks,
            "protocol": job.protocol.content_hash(),
            "code": job.code_sha,
            "strict": job.strict,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]
