"""The `ablation` proposer: the champion without one of its techniques (and whatever needs
it), to find techniques that do not pay. The loop measures each against the champion in one
job: a leave-one-out that is faster beyond the noise bar replaces the champion through the
gate like any candidate, and one that is not says in its reason whether the technique left
out pays (leaving it out is slower) or not (no measurable difference).
"""

from __future__ import annotations

from orchestrate.api.proposer import ExplorationState, Proposal, Proposer, technique_key
from orchestrate.proposers import graph


class Ablation(Proposer):
    name = "ablation"
    summary = "the champion without one technique (and those that need it): does it pay?"

    def propose(self, state: ExplorationState, n: int) -> list[Proposal]:
        tried = state.tried_keys() | {technique_key(state.champion), technique_key(state.root)}
        out = []
        for name in reversed(graph.names(state.champion)):  # the latest addition first
            stack = graph.without(state.champion, name, state.catalogue)
            if stack is None or not stack.techniques or technique_key(stack) in tried:
                continue
            dropped = sorted(set(graph.names(state.champion)) - set(graph.names(stack)))
            why = f"leaves out {', '.join(dropped)}: does {name} pay for itself?"
            out.append(Proposal(stack=stack, change=f"-{name}", reason=why))
            if len(out) == n:
                break
        return out
