"""The jobs an exploration measures a candidate in, and the identity it dedups on.

Every job holds the candidate's parent (the champion) and the candidate, so the speedup over
the champion is a paired estimate from one interleaved job. Stock (the baseline every
headline is against) is in the jobs whose answer is against stock: the fresh-seed
remeasure, the gate's, and a development job only while stock is the champion or a proposer
reads every candidate's headline (`Proposer.reads_headlines`). On the H200 stock's Python
token loop took about 24 ms a token against 1.5 for a captured one: in a development job of a
fast champion, timing stock was most of the job. The development job uses the workload's
seeds; the remeasure uses fresh seeds, different for every candidate, so no candidate is
promoted on seeds it was selected on. Every recording is kept: the guards read them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrate.api import protocol as proto
from orchestrate.api.config import ModelSpec, StackSpec, TechniqueRef, Workload
from orchestrate.api.proposer import canonical_techniques, technique_key
from orchestrate.api.protocol import Protocol
from orchestrate.api.records import JobSpec
from orchestrate.api.registry import StackError, build_stack, job_identity, technique_code
from orchestrate.running.plan import plan_job

DESCRIPTION = "proposed by orchestrate explore"
FRESH = "fresh"  # the phase name of fresh-seed remeasures: workload `NAME@fresh`


def canonical(stack: StackSpec, stock: StackSpec) -> StackSpec:
    """`stack` as the exploration records it: every parameter spelled out, and named after
    what it applies ("static_kv_cache.audio_head-3fa2c1"), so two proposals of the same
    stack get the same name and a name says what a stack is."""
    techniques = canonical_techniques(stack)
    if not techniques:
        return stock
    spec = StackSpec(name="candidate", family=stack.family, techniques=techniques)
    return spec.model_copy(update={"name": canonical_name(spec), "description": DESCRIPTION})


def canonical_name(spec: StackSpec) -> str:
    """What `spec` applies, in order, and a hash of it: at most 100 characters (a stack's
    name becomes a folder name), the techniques part cut to make room for the hash."""
    short = hashlib.sha256(technique_key(spec).encode()).hexdigest()[:6]
    base = ".".join(t.name for t in spec.techniques)[: 100 - len(short) - 1].rstrip(".")
    return f"{base}-{short}"


def stored_stack(spec: dict[str, Any]) -> StackSpec:
    """A candidate's stored stack. Before canonical_name kept to 100 characters, a stack of
    many techniques was stored under a longer name, which no longer validates (exploration
    59be54fef175's #19): that one is named as canonical_name names it now."""
    try:
        return StackSpec.model_validate(spec)
    except ValidationError:
        renamed = StackSpec.model_validate(spec | {"name": "candidate"})
        return renamed.model_copy(update={"name": canonical_name(renamed)})


def same(a: StackSpec, b: StackSpec) -> bool:
    return technique_key(a) == technique_key(b)


def job_stacks(
    stock: StackSpec, champion: StackSpec, candidates: list[StackSpec], with_stock: bool = True
) -> list[StackSpec]:
    """The job's stacks, its baseline first: stock (`with_stock`, or when it is the
    champion), the champion, the candidates."""
    if same(champion, stock):
        return [stock, *candidates]
    return [*([stock] if with_stock else []), champion, *candidates]


def combine(champion: StackSpec, winners: list[StackSpec]) -> StackSpec | None:
    """`champion` with each winner's added techniques, winners in the order given (best
    first): a winner whose techniques do not fit with those already taken (a slot filled, a
    conflict, other params for the same technique) is left out whole. None: none fit."""
    stack, took = champion, 0
    for winner in winners:
        grown: StackSpec | None = stack
        for ref in winner.techniques:
            if grown is None:
                break
            mine = {t.name: t for t in grown.techniques}
            if ref.name in mine:
                grown = grown if mine[ref.name].params == ref.params else None
            else:
                grown = _insert(grown, ref)
        if grown is not None:
            stack, took = grown, took + 1
    return stack if took else None


def covers(stack: StackSpec, part: StackSpec) -> bool:
    """Every technique of `part`, with its params, is in `stack`."""
    mine = {t.name: t.params for t in stack.techniques}
    return all(t.name in mine and mine[t.name] == t.params for t in part.techniques)


def _insert(stack: StackSpec, ref: TechniqueRef) -> StackSpec | None:
    """`stack` with `ref` at the latest place the registry accepts, or None."""
    for at in range(len(stack.techniques), -1, -1):
        refs = [*stack.techniques[:at], ref, *stack.techniques[at:]]
        grown = stack.model_copy(update={"name": f"{stack.name}+", "techniques": refs})
        try:
            build_stack(grown)  # names, params, slots, order, conflicts
        except StackError:
            continue
        return grown
    return None


def dev_workload(dev: Workload) -> Workload:
    return Workload.model_validate(dev.model_dump() | {"save_audio": _every(dev)})


def fresh_workload(dev: Workload, protocol: Protocol, draw: int) -> Workload:
    """`dev` on seeds it never had: each shifted by `draw` x the protocol's seed stride."""
    stride = protocol.noise.seed_stride
    seeds = [s + stride * draw for s in dev.seeds]
    name = proto.phase_workload(dev.name, FRESH)
    return Workload.model_validate(
        dev.model_dump() | {"name": name, "seeds": seeds, "save_audio": _every(dev)}
    )


def _every(w: Workload) -> int:
    return len(w.prompts) * len(w.seeds)


def plan(
    model: ModelSpec,
    workload: Workload,
    stacks: list[StackSpec],
    protocol: Protocol,
    runs_dir: Path,
    fidelity_steps: int,
) -> JobSpec:
    return plan_job(model, workload, stacks, protocol, runs_dir, fidelity_steps=fidelity_steps)


def candidate_identity(job: JobSpec, candidate: StackSpec, hardware: str) -> str:
    """The candidate alone in `job`'s setting (model, workload, its techniques' code, the
    protocol, the commit and uncommitted changes) on `hardware`: equal identities measured
    the same thing, so the second is never submitted. Its name and parent do not count."""
    alone = job.model_copy(
        update={
            "stacks": [candidate.model_copy(update={"name": "candidate", "description": ""})],
            "technique_code": technique_code([candidate]),
        }
    )
    blob = json.dumps({"job": job_identity(alone), "hardware": hardware}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]
