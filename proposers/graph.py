"""The technique graph as proposers walk it: which techniques a stack can take one more of,
and what is left when one is taken out, read from the catalogue in the exploration's state
(declared slots, `requires`, `after`, `conflicts`) and checked with api.registry.build_stack,
so a proposal is always a stack the registry accepts.
"""

from __future__ import annotations

from typing import Any

from orchestrate.api.config import StackSpec, TechniqueRef
from orchestrate.api.registry import StackError, build_stack


def names(stack: StackSpec) -> list[str]:
    return [t.name for t in stack.techniques]


def runs_here(meta: dict[str, Any], caps: list[str]) -> bool:
    """Every requirement of a technique met by the device (state.device_caps)."""
    return set(meta["requires"]) <= set(caps)


def valid(stack: StackSpec) -> bool:
    try:
        build_stack(stack)  # names, params, slots, order, conflicts: no device check here
    except StackError:
        return False
    return True


def extend(
    stack: StackSpec,
    name: str,
    catalogue: dict[str, dict[str, Any]],
    caps: list[str] | None = None,
) -> StackSpec | None:
    """`stack` with technique `name` added where the registry accepts it (after everything
    it needs, before anything that needs it: the latest such place), or None. What `name`
    needs (`after`) and the stack lacks comes with it, first (`needs_of`): packed
    projections from stock bring the static cache, as a person would try them."""
    if name in names(stack):
        return None
    needs = needs_of(stack, name, catalogue)
    if caps is not None and not all(runs_here(catalogue[t], caps) for t in needs):
        return None  # it needs a technique this device cannot run
    for need in needs:
        grown = _insert(stack, need, catalogue)
        if grown is None:
            return None
        stack = grown
    return _insert(stack, name, catalogue)


def needs_of(stack: StackSpec, name: str, catalogue: dict[str, dict[str, Any]]) -> list[str]:
    """The techniques `name` needs (`after`, through any chain) that `stack` lacks, those
    needed first."""
    have, out = set(names(stack)), []

    def visit(t: str) -> None:
        for need in catalogue.get(t, {}).get("after", []):
            if need in have or need in out or need not in catalogue:
                continue
            visit(need)
            out.append(need)

    visit(name)
    return out


def _insert(stack: StackSpec, name: str, catalogue: dict[str, dict[str, Any]]) -> StackSpec | None:
    if name in names(stack):
        return None
    claimed = {slot for t in names(stack) for slot in catalogue.get(t, {}).get("slots", [])}
    if claimed & set(catalogue[name]["slots"]):
        return None  # a slot already filled: that is a swap, not one more technique
    for at in range(len(stack.techniques), -1, -1):
        refs = [*stack.techniques[:at], TechniqueRef(name=name), *stack.techniques[at:]]
        candidate = stack.model_copy(update={"name": f"{stack.name}-x", "techniques": refs})
        if valid(candidate):
            return candidate
    return None


def conflicting(stack: StackSpec, name: str, catalogue: dict[str, dict[str, Any]]) -> list[str]:
    """The techniques of `stack` that `name` conflicts with, whichever side declares it."""
    declared = set(catalogue.get(name, {}).get("conflicts", []))
    return [
        t for t in names(stack)
        if t in declared or name in catalogue.get(t, {}).get("conflicts", [])
    ]  # fmt: skip


def instead(
    stack: StackSpec,
    name: str,
    catalogue: dict[str, dict[str, Any]],
    caps: list[str] | None = None,
) -> tuple[StackSpec, list[str]] | None:
    """`stack` with `name` in place of the techniques it conflicts with (and those that
    need them), as `extend` adds it; (the stack, what it took out), or None when `name`
    conflicts with nothing there or does not fit even then. Two ways of doing one job (a
    per-token graph and a captured loop) are a swap, which one more technique cannot be."""
    gone = conflicting(stack, name, catalogue)
    base: StackSpec | None = stack
    for t in gone:
        base = without(base, t, catalogue) if base is not None else None
    if not gone or base is None:
        return None
    grown = extend(base, name, catalogue, caps)
    if grown is None:
        return None
    return grown, [t for t in names(stack) if t not in names(base)]


def without(stack: StackSpec, name: str, catalogue: dict[str, dict[str, Any]]) -> StackSpec | None:
    """`stack` without `name` and without every technique that needs it (`after`, through
    any chain), or None when what is left does not validate."""
    gone = {name}
    changed = True
    while changed:
        needs = {t for t in names(stack) if set(catalogue.get(t, {}).get("after", [])) & gone}
        changed = not needs <= gone
        gone |= needs
    refs = [t for t in stack.techniques if t.name not in gone]
    candidate = stack.model_copy(update={"name": f"{stack.name}-x", "techniques": refs})
    return candidate if valid(candidate) else None


def exact(catalogue: dict[str, dict[str, Any]], added: list[str]) -> bool:
    """Every technique of `added` declares itself exact (what fidelity then checks)."""
    return all(catalogue[t].get("exact", False) for t in added)


def change(champion: StackSpec, stack: StackSpec, name: str, gone: list[str]) -> str:
    """How a proposal names its step from `champion` to `stack`: "+graph_loop (with
    device_sampler; instead of cuda_graph)", what came along and what went out."""
    had = names(champion)
    brought = [t for t in names(stack) if t not in had and t != name]
    notes = ([f"with {', '.join(brought)}"] if brought else []) + (
        [f"instead of {', '.join(gone)}"] if gone else []
    )
    return f"+{name}" + (f" ({'; '.join(notes)})" if notes else "")
