"""The `ladder` proposer: the champion plus one technique, cheapest expected gain first.

Walks the technique graph from the champion: every technique of the family that is not in
it yet, whose requirements the device meets (state.device_caps), whose slots are still free,
and that the registry accepts at some place in the stack (no conflict). A technique that
needs others (`after`) the champion lacks brings them along ("+graph_loop (with
static_kv_cache, device_sampler)"): otherwise a loop that needs a cache is never tried
from stock, and the largest single step of both write-ups is out of the ladder's reach.
A technique whose step could not run on this device (refused at build: a missing package, a
mode for CUDA only) is not proposed again on a later champion, nor is a change that made an
earlier champion slower beyond noise (`ExplorationState.lost_moves`). A technique that
conflicts with one the champion has takes its place ("+graph_loop (with
device_sampler; instead of cuda_graph)"): the write-ups went from a per-token CUDA graph to a
captured decode loop, which a ladder that only adds would never reach. Decoding knobs
(techniques claiming only `knob.*` slots) are left to `params`.

Cheapest expected gain first, by a static prior, as both write-ups climbed their ladders:
exact techniques before approximate ones (they need no quality judgement), fewer device
requirements before more (a technique needing only the CPU costs no compile or kernel
build), then the family's slot order (the decoder before the head before the loop), then
the name, so the order is the same on every run.
"""

from __future__ import annotations

from typing import Any

from orchestrate.api.proposer import ExplorationState, Proposal, Proposer, technique_key
from orchestrate.api.registry import StackError, get_family
from orchestrate.proposers import graph


class Ladder(Proposer):
    name = "ladder"
    summary = (
        "the champion plus one technique (slots, requires, after, device), or in place of "
        "those it conflicts with; exact first"
    )

    def propose(self, state: ExplorationState, n: int) -> list[Proposal]:
        tried = state.tried_keys() | {technique_key(state.champion)}
        refused = state.refused_techniques()
        lost = state.lost_moves()
        out = []
        for name in sorted(state.catalogue, key=lambda t: self.prior(state, t)):
            meta = state.catalogue[name]
            if _knob_only(meta) or not graph.runs_here(meta, state.device_caps):
                continue
            if name in refused:  # it could not run here on an earlier champion
                continue
            stack = graph.extend(state.champion, name, state.catalogue, state.device_caps)
            gone: list[str] = []
            if stack is None:
                swap = graph.instead(state.champion, name, state.catalogue, state.device_caps)
                stack, gone = swap if swap is not None else (None, [])
            if stack is None or technique_key(stack) in tried:
                continue
            had = graph.names(state.champion)
            added = [t for t in graph.names(stack) if t not in had]
            kind = "exact" if graph.exact(state.catalogue, added) else "approximate"
            slots = ", ".join(meta["slots"] + meta["wraps"]) or "-"
            why = f"{kind}, slot {slots}: {meta['summary']}"
            change = graph.change(state.champion, stack, name, gone)
            if change in lost:  # slower beyond noise on an earlier champion
                continue
            out.append(Proposal(stack=stack, change=change, reason=why))
            if len(out) == n:
                break
        return out

    @staticmethod
    def prior(state: ExplorationState, name: str) -> tuple[Any, ...]:
        """Exact before approximate (counting what the technique brings with it), fewer
        device requirements, the family's slot order, fewer techniques added, the name."""
        meta = state.catalogue[name]
        needs = graph.needs_of(state.champion, name, state.catalogue)
        exact = graph.exact(state.catalogue, [*needs, name])
        return (not exact, len(meta["requires"]), _slot_rank(state, meta), len(needs), name)


def _knob_only(meta: dict[str, Any]) -> bool:
    slots = meta["slots"] + meta["wraps"]
    return bool(slots) and all(s.startswith("knob.") for s in slots)


def _slot_rank(state: ExplorationState, meta: dict[str, Any]) -> int:
    try:
        order = list(get_family(state.family).slots)
    except StackError:
        order = []
    ranks = [order.index(s) for s in meta["slots"] + meta["wraps"] if s in order]
    return min(ranks, default=len(order))
