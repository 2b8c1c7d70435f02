"""The `profile` proposer: spend the next jobs where the champion spends its time.

It reads the champion's per-slot time (state.profile: slot -> ms per step, the worker's
`slot_ms.*` metrics), takes the costliest slot and proposes the catalogue's techniques that
fill or wrap it, each appended to the champion. A technique that fills a slot the champion
already fills exclusively replaces that occupant in place (another implementation of the
same slot), unless a later technique needs the occupant. Only techniques this device can
run, whose `after` the champion already has, with no conflict, never tried before, and
accepted by stack validation. Exact techniques come first (they need no quality gate).
When nothing fits the costliest slot, the next one; an empty profile proposes nothing.
"""

from __future__ import annotations

import json
import re
from typing import Any

from orchestrate.api.config import StackSpec, TechniqueRef
from orchestrate.api.proposer import ExplorationState, Proposal, Proposer
from orchestrate.api.registry import StackError, build_stack, get


class ProfileProposer(Proposer):
    name = "profile"
    summary = "techniques for the slot that costs the champion the most time per step"

    def propose(self, state: ExplorationState, n: int) -> list[Proposal]:
        total = sum(state.profile.values())
        seen = {identity(t.stack) for t in state.tried} | {identity(state.champion)}
        for slot, ms in sorted(state.profile.items(), key=lambda kv: (-kv[1], kv[0])):
            out: list[Proposal] = []
            for name in candidates(state, slot):
                move = _move(state, name)
                if move is None:
                    continue
                stack, change = move
                key = identity(stack)
                if key in seen or _invalid(stack):
                    continue
                seen.add(key)
                share = f"{ms / total:.0%} of" if total > 0 else "of"
                verb = "fills" if slot in state.catalogue[name].get("slots", ()) else "wraps"
                reason = (
                    f"slot {slot!r} is the costliest with an untried technique: {ms:.3g} ms "
                    f"per step, {share} the champion's profiled time; {name} {verb} it"
                )
                out.append(Proposal(stack=stack, change=change, reason=reason))
                if len(out) >= n:
                    break
            if out:
                return out
        return []


def candidates(state: ExplorationState, slot: str) -> list[str]:
    """Techniques that fill or wrap `slot`, runnable here and not in the champion; exact
    ones first, then by name."""
    champion = {t.name for t in state.champion.techniques}
    found = []
    for name, meta in state.catalogue.items():
        claims = (*meta.get("slots", ()), *meta.get("wraps", ()))
        if slot not in claims or name in champion:
            continue
        if any(r not in state.device_caps for r in meta.get("requires", ())):
            continue
        if not set(meta.get("after", ())) <= champion:
            continue
        if champion & set(meta.get("conflicts", ())) or any(
            name in state.catalogue.get(t, {}).get("conflicts", ()) for t in champion
        ):
            continue
        found.append(name)
    return sorted(found, key=lambda n: (not state.catalogue[n].get("exact", False), n))


def _move(state: ExplorationState, name: str) -> tuple[StackSpec, str] | None:
    """The champion with `name` added, or swapped in for the one technique that already
    fills its slot; None when more than one would have to go, or a later one needs it."""
    champ = list(state.champion.techniques)
    slots = set(state.catalogue[name].get("slots", ()))
    occupants = [
        i
        for i, t in enumerate(champ)
        if slots & set(state.catalogue.get(t.name, {}).get("slots", ()))
    ]
    new = TechniqueRef(name=name)
    if not occupants:
        techniques, change = [*champ, new], f"+{name}"
    elif len(occupants) == 1:
        old = champ[occupants[0]].name
        if any(old in state.catalogue.get(t.name, {}).get("after", ()) for t in champ):
            return None
        techniques = [new if i == occupants[0] else t for i, t in enumerate(champ)]
        change = f"-{old}+{name}"
    else:
        return None
    base = state.champion.name
    stack = StackSpec(
        name=re.sub(r"[^A-Za-z0-9_.\-]", "-", f"{base}.{name}"),
        family=state.champion.family,
        description=f"profile: {change} on {base}",
        techniques=techniques,
    )
    return stack, change


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
