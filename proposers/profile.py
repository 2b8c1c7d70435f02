"""The `profile` proposer: spend the next jobs where the champion spends its time.

It reads the champion's profile (state.profile: slot -> ms per step, the worker's
`slot_ms.*` metrics, and `host`: the ms per step the GPU sits idle while the host runs
Python and launches kernels), takes the costliest entry and proposes the catalogue's
techniques that fill or wrap that slot, or that declare they reduce that cost
(`Technique.reduces`). When the GPU idles for most of a step, `host` comes first whatever
the slots say: every slot's time is then mostly host work, which no change inside one slot
removes (both write-ups captured the step before they touched a kernel).

Each proposal is the champion changed by one technique, as the ladder would make it: added,
with what it needs (`after`) brought along; or in place of the one technique already filling
its slot; or in place of those it conflicts with. Only techniques this device can run (none
whose step was refused here before), never tried or pending in this round, not a change
that made an earlier champion slower beyond noise, and accepted by stack validation. Exact
techniques come first (they need no quality gate). When nothing fits the costliest entry,
the next one; an empty profile proposes nothing.
"""

from __future__ import annotations

import json
import re
from typing import Any

from orchestrate.api.config import StackSpec, TechniqueRef
from orchestrate.api.proposer import ExplorationState, Proposal, Proposer
from orchestrate.api.registry import StackError, build_stack, get
from orchestrate.api.technique import HOST
from orchestrate.proposers import graph


class ProfileProposer(Proposer):
    name = "profile"
    summary = (
        "techniques for what costs the champion most per step: its costliest slot, or host "
        "work when the GPU idles most of a step"
    )

    def propose(self, state: ExplorationState, n: int) -> list[Proposal]:
        # tried, and pending: another proposer's proposal of this round is not made twice
        seen = {identity(s) for s in [*(t.stack for t in state.tried), *state.pending]}
        seen.add(identity(state.champion))
        captured = _captured(state)
        lost = state.lost_moves()  # slower beyond noise on an earlier champion
        for key, ms in costs(state.profile):
            if key in captured:
                continue
            out: list[Proposal] = []
            for name in candidates(state, key):
                move = _move(state, name)
                if move is None:
                    continue
                stack, change = move
                if identity(stack) in seen or change in lost or _invalid(stack):
                    continue
                seen.add(identity(stack))
                reason = f"{_where(state.profile, key, ms)}; {name} {_verb(state, name, key)} it"
                out.append(Proposal(stack=stack, change=change, reason=reason))
                if len(out) >= n:
                    break
            if out:
                return out
        return []


def costs(profile: dict[str, float]) -> list[tuple[str, float]]:
    """The profile's entries, costliest first; `host` first when it is at least half the
    step (the slots' times add up to about a step: each includes the host work inside it)."""
    slots = sorted(
        ((k, v) for k, v in profile.items() if k != HOST), key=lambda kv: (-kv[1], kv[0])
    )
    if HOST not in profile:
        return slots
    host = (HOST, profile[HOST])
    if host[1] >= sum(v for _, v in slots) / 2:
        return [host, *slots]
    return sorted([*slots, host], key=lambda kv: (-kv[1], kv[0]))


def _captured(state: ExplorationState) -> set[str]:
    """What not to chase once the champion captures the step (a technique of it reduces
    host work): the slots that technique fills or wraps, whose time is the replayed step
    with every slot's kernels inside it (api.slot_clock), and the cost it reduces, as the
    GPU idles inside a replayed step for reasons no other capture removes. On the H200
    graph_loop's `loop` held 4.63 of 4.86 ms a token and the GPU idled 0.51: another loop
    proposed for either would be chasing the whole step. (Swapping one capture for
    another stays the ladder's move.)"""
    out: set[str] = set()
    for t in state.champion.techniques:
        meta = state.catalogue.get(t.name, {})
        if meta.get("reduces"):
            out |= {*meta.get("slots", ()), *meta.get("wraps", ()), *meta["reduces"]}
    return out


def _where(profile: dict[str, float], key: str, ms: float) -> str:
    total = sum(v for k, v in profile.items() if k != HOST)
    if key == HOST:
        share = f" ({ms / total:.0%} of the step)" if total > 0 else ""
        return f"the GPU sits idle {ms:.3g} ms per step{share}: host work"
    share = f"{ms / total:.0%} of" if total > 0 else "of"
    return (
        f"slot {key!r} is the costliest with an untried technique: {ms:.3g} ms per step, "
        f"{share} the champion's profiled time"
    )


def _verb(state: ExplorationState, name: str, key: str) -> str:
    meta = state.catalogue[name]
    if key in meta.get("slots", ()):
        return "fills"
    return "wraps" if key in meta.get("wraps", ()) else "reduces"


def candidates(state: ExplorationState, key: str) -> list[str]:
    """Techniques that fill or wrap slot `key`, or reduce cost `key`; runnable here (with
    everything they bring along) and not in the champion; exact ones first (counting what
    they bring), then by name."""
    champion = {t.name for t in state.champion.techniques}
    refused = state.refused_techniques()  # could not run here on an earlier champion
    found = []
    for name, meta in state.catalogue.items():
        claims = (*meta.get("slots", ()), *meta.get("wraps", ()), *meta.get("reduces", ()))
        if key not in claims or name in champion or name in refused:
            continue
        brings = graph.needs_of(state.champion, name, state.catalogue)
        if not all(graph.runs_here(state.catalogue[t], state.device_caps) for t in [*brings, name]):
            continue
        found.append((not graph.exact(state.catalogue, [*brings, name]), name))
    return [name for _, name in sorted(found)]


def _move(state: ExplorationState, name: str) -> tuple[StackSpec, str] | None:
    """The champion changed by `name`: in place of the one technique already filling its
    slot (unless a later one needs it), in place of those it conflicts with, or added with
    what it needs; None when none of these makes a stack the registry accepts."""
    champ, cat = state.champion, state.catalogue
    stack: StackSpec | None
    if graph.conflicting(champ, name, cat):
        swap = graph.instead(champ, name, cat, state.device_caps)
        if swap is None:
            return None
        stack, gone = swap
        return _named(state, stack), graph.change(champ, stack, name, gone)
    occupants = [
        t.name for t in champ.techniques if set(cat[name]["slots"]) & set(cat[t.name]["slots"])
    ]
    if len(occupants) > 1:
        return None
    if occupants:
        (old,) = occupants
        if any(old in cat[t.name].get("after", ()) for t in champ.techniques) or graph.needs_of(
            champ, name, cat
        ):
            return None
        refs = [TechniqueRef(name=name) if t.name == old else t for t in champ.techniques]
        stack = champ.model_copy(update={"techniques": refs})
        return _named(state, stack), f"-{old}+{name}"
    stack = graph.extend(champ, name, cat, state.device_caps)
    if stack is None:
        return None
    return _named(state, stack), graph.change(champ, stack, name, [])


def _named(state: ExplorationState, stack: StackSpec) -> StackSpec:
    base = state.champion.name
    added = "-".join(t for t in graph.names(stack) if t not in graph.names(state.champion))
    return stack.model_copy(
        update={
            "name": re.sub(r"[^A-Za-z0-9_.\-]", "-", f"{base}.{added or 'swap'}"),
            "description": f"profile: on {base}",
        }
    )


def _invalid(stack: StackSpec) -> bool:
    try:
        build_stack(stack)  # check_stack and the rest, before a job is spent on it
    except StackError:
        return True
    return False


def identity(stack: StackSpec) -> str:
    """Techniques in order with validated params, whatever the stack is called."""
    parts: list[Any] = []
    for ref in stack.techniques:
        try:
            params = get(ref.name).Params.model_validate(ref.params).model_dump(mode="json")
        except Exception:
            params = ref.params
        parts.append([ref.name, params])
    return json.dumps([stack.family, parts], sort_keys=True)
