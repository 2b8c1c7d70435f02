"""Config -> plan: validate every stack up front and produce a serialisable job.

Validation here is static (names, family, params, conflicts, order), so a bad stack fails
before any model is built or GPU time is spent. Device requirements are checked again by
the worker, on the device that will run them.

A workload holding a sealed holdout text, or a near copy of one, is refused here
(HoldoutLeak, which the callers holding a store audit). The gate's holdout job carries
placeholders instead of texts and names its sealed file (`sealed_file`); see api/sealed.py.
"""

from __future__ import annotations

from pathlib import Path

from orchestrate.api import sealed
from orchestrate.api.config import ModelSpec, StackSpec, Workload
from orchestrate.api.protocol import Protocol
from orchestrate.api.records import JobSpec
from orchestrate.api.registry import StackError, build_stack, get, get_family, technique_code
from orchestrate.api.technique import BuiltStack, DeviceCaps
from orchestrate.running.environment import code_state
from orchestrate.running.serving import LoadError, load_shape


def plan_job(
    model: ModelSpec,
    workload: Workload,
    stacks: list[StackSpec],
    protocol: Protocol,
    output_root: Path,
    strict: bool = False,
    fidelity_steps: int = 32,
    check_device: bool = True,
    sealed_file: Path | None = None,
) -> JobSpec:
    leaks = sealed.find_leaks(workload)  # first: nothing else about this job matters
    if leaks:
        raise sealed.HoldoutLeak(workload.name, leaks, stacks, protocol.content_hash())
    ref = None if sealed_file is None else sealed.sealed_ref(sealed_file)
    sealed.resolve(workload, ref)  # placeholders need their file and its texts unchanged
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
        built = build_stack(stack, caps, strict=strict)  # raises on anything invalid
        check_serving(stack.name, built, workload)
    if workload.load is not None:  # a sustained load too short for its streams, before building
        try:
            load_shape(workload.load, get_family(model.family).frame_s)
        except LoadError as exc:
            raise StackError(f"workload {workload.name!r}: {exc}") from exc
    if fidelity_steps < 0:  # before pydantic, whose message would name a model, not an option
        raise ValueError(f"fidelity steps must be >= 0, got {fidelity_steps}")
    code = code_state()  # everything that changes the measurement is part of the identity
    job = JobSpec(
        model=model,
        workload=workload,
        stacks=stacks,
        protocol=protocol,
        strict=strict,
        fidelity_steps=fidelity_steps,
        output_dir="",
        code_sha=code.sha,
        code_dirty=code.dirty,
        code_diff_hash=code.diff_hash,
        technique_code=technique_code(stacks),
        sealed_file=ref,
    )
    return job.model_copy(update={"output_dir": str(output_root / job.job_id)})


def check_serving(stack: str, built: BuiltStack, workload: Workload) -> None:
    """A serving workload (one with a `load:`) needs a technique that serves many streams
    in every stack, and such a technique belongs on no other workload; each technique may
    refuse the load itself (more streams than its rows)."""
    servers = [t.name for t in built.techniques if t.serves_streams]
    if workload.load is None and servers:
        raise StackError(
            f"stack {stack!r}: {servers[0]} serves many streams at once, but workload "
            f"{workload.name!r} is single-stream (it has no `load:`); run it on a serving "
            "workload, e.g. --workload serve-smoke"
        )
    if workload.load is not None and not servers:
        skipped = "; ".join(
            f"{name} is skipped here: {why}"
            for name, why in built.skipped.items()
            if get(name).serves_streams
        )
        raise StackError(
            f"stack {stack!r} cannot serve workload {workload.name!r} "
            f"({workload.load.label()}): "
            + (skipped or "it has no technique that serves many streams (rumik: "
               "batched_decode; omnivoice: batched_requests)")
        )  # fmt: skip
    for technique in built.techniques:
        why = technique.check_workload(technique.params, workload)
        if why:
            raise StackError(f"stack {stack!r}: {technique.name}: {why}")


def prefix_stack(spec: StackSpec, n: int) -> StackSpec:
    """The first `n` techniques of `spec`, as a stack of its own (`NAME-pN`)."""
    return spec.model_copy(
        update={
            "name": f"{spec.name}-p{n}",
            "description": f"first {n} techniques of {spec.name}",
            "techniques": spec.techniques[:n],
        }
    )
