"""What a proposer plugin is: it reads an exploration's state and proposes stacks to try.

`orchestrate explore` drives the loop (measure, remeasure, gate, decide); a proposer only
says what to try next and why. A plugin author writes one module:

    class OneMore(Proposer):
        name = "one_more"
        summary = "one line for `orchestrate proposers`"

        def propose(self, state, n):
            return [Proposal(stack=..., change="+my_technique", reason="...")]

and one entry-point line in its pyproject.toml:

    [project.entry-points."orchestrate.proposers"]
    one_more = "my_package.my_module:OneMore"

Proposers see only this module and the rest of `orchestrate.api` (like techniques): the
loop hands them a plain, JSON-serialisable `ExplorationState`, never the store.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import ValidationError

from orchestrate.api.config import StackSpec, TechniqueRef

# What the loop decided about one candidate (the ledger's vocabulary).
Decision = Literal[
    "drop",  # measured, not faster than its parent beyond the noise bar
    "remeasure",  # looked faster: measured again on fresh seeds before any gate
    "gate",  # sent to the phase gate (fresh dev remeasure, then the sealed holdout)
    "accept",  # the gate accepted it: the exploration's new champion
    "retain",  # the gate kept the current champion
    "invalid",  # a guard refused the measurement (faster than the floor, audio not
    # depending on its prompt or seed, an exactness claim that failed)
    "error",  # the stack failed to build or run; recorded, the exploration goes on
    "duplicate",  # its identity was already measured: never submitted
    "superseded",  # cleared its remeasure, but a round-mate was accepted first: measured
    # against a champion that is no longer it, its change is proposed again from the new one
]


def canonical_techniques(stack: StackSpec) -> list[TechniqueRef]:
    """`stack`'s techniques with every parameter spelled out (the technique's defaults
    filled in), so `{}` and the defaults written out name the same stack. A technique not
    installed here keeps its params as given (the stack will fail to plan, and say why)."""
    from orchestrate.api.registry import StackError, get

    out = []
    for ref in stack.techniques:
        try:
            params = get(ref.name).Params.model_validate(ref.params).model_dump(mode="json")
        except (StackError, ValidationError):
            params = dict(ref.params)
        out.append(TechniqueRef(name=ref.name, params=params))
    return out


def technique_key(stack: StackSpec) -> str:
    """What a stack applies, without its name or description: its family and each technique
    with its (canonical) params, in order. Proposals with equal keys are the same stack."""
    techniques = [[t.name, t.params] for t in canonical_techniques(stack)]
    return json.dumps({"family": stack.family, "techniques": techniques}, sort_keys=True)


# How a dev step's reason starts when its stack could not run here (explore.decisions).
REFUSED_HERE = ("refused:", "partial:")


def refused_here(decision: str | None, reason: str | None) -> bool:
    """A decided candidate that could not run on this device: refused at build (a package, a
    mode for CUDA only, a model the technique cannot patch) or run with a technique skipped.
    It measured nothing: it spends no patience, and proposers do not offer it again."""
    return decision == "error" and (reason or "").startswith(REFUSED_HERE)


@dataclass(frozen=True)
class Proposal:
    """One stack to try: the full stack, what it changes against its parent, and why."""

    stack: StackSpec
    change: str  # "+int8_projections", "-pdl", "decoding.num_step=10"
    reason: str
    parent: str | None = None  # the parent stack's name; None means the current champion


@dataclass(frozen=True)
class Tried:
    """A candidate the exploration already measured (or refused), as proposers see it."""

    stack: StackSpec
    change: str
    proposer: str
    decision: Decision
    reason: str
    headline: float | None = None  # paired speedup against stock (None: no job of it had stock)
    headline_lo: float | None = None
    headline_hi: float | None = None
    vs_parent: float | None = None  # paired speedup against its parent, its latest job
    vs_parent_hi: float | None = None  # that speedup's 95% CI upper bound
    quality: dict[str, float] = field(default_factory=dict)  # metric -> value, when scored

    @property
    def refused_here(self) -> bool:
        return refused_here(self.decision, self.reason)


@dataclass(frozen=True)
class ExplorationState:
    """What a proposer may read. Everything here is plain data, so `to_json` is exact and
    the `agent` proposer can hand it to an external command unchanged."""

    family: str
    device: str  # "cpu" | "cuda"
    device_caps: list[str]  # requirements this device meets ("cuda", "sm90", ...)
    champion: StackSpec
    champion_headline: float | None  # paired speedup of the champion against the root
    root: StackSpec  # what the exploration started from (`--from`)
    min_speedup: float  # the protocol's noise-derived bar a change must clear
    catalogue: dict[str, dict[str, Any]]  # technique -> {summary, exact, slots, requires,
    # after, conflicts, params_schema}; only this family's techniques
    tried: list[Tried] = field(default_factory=list)
    profile: dict[str, float] = field(default_factory=dict)  # slot -> ms per step, champion
    pending: list[StackSpec] = field(default_factory=list)  # proposed this round, undecided

    def refused_techniques(self) -> set[str]:
        """Techniques whose one-technique step ("+name ...") could not run on this device: a
        ladder that proposes them again on every new champion only spends jobs."""
        return {
            t.change.split()[0][1:]
            for t in self.tried
            if t.refused_here and t.change.startswith("+")
        }

    def lost_moves(self) -> set[str]:
        """Changes ("+cuda_graph (instead of graph_loop)") that made a candidate slower than
        its parent beyond noise (the paired CI's upper bound below 1): a proposer that makes
        the same change on each new champion only spends jobs. The H200 exploration from
        stock made that swap four times, 0.81x to 0.89x each (4 of its 25 candidates)."""
        return {t.change for t in self.tried if t.vs_parent_hi is not None and t.vs_parent_hi < 1.0}

    def tried_keys(self) -> set[str]:
        """technique_key of every stack tried or pending (names aside: the loop names
        candidates), so a proposer asked again in the same round proposes something new."""
        return {technique_key(t.stack) for t in self.tried} | {
            technique_key(s) for s in self.pending
        }

    def to_json(self) -> dict[str, Any]:
        def stack(s: StackSpec) -> dict[str, Any]:
            return s.model_dump(mode="json")

        return {
            "family": self.family,
            "device": self.device,
            "device_caps": self.device_caps,
            "root": stack(self.root),
            "champion": stack(self.champion),
            "champion_headline": self.champion_headline,
            "min_speedup": self.min_speedup,
            "catalogue": self.catalogue,
            "profile": self.profile,
            "pending": [stack(s) for s in self.pending],
            "tried": [
                {
                    "stack": stack(t.stack),
                    "change": t.change,
                    "proposer": t.proposer,
                    "decision": t.decision,
                    "reason": t.reason,
                    "headline": t.headline,
                    "headline_lo": t.headline_lo,
                    "headline_hi": t.headline_hi,
                    "vs_parent": t.vs_parent,
                    "vs_parent_hi": t.vs_parent_hi,
                    "quality": t.quality,
                }
                for t in self.tried
            ],
        }


class ProposerError(RuntimeError):
    """A proposer failed or returned something malformed: the loop records it in the
    exploration's ledger and goes on with the other proposers."""


class Proposer(abc.ABC):
    name: ClassVar[str]
    summary: ClassVar[str] = ""
    # True: it needs every candidate's headline (paired against stock), so the loop times
    # stock in development jobs too; otherwise a candidate dropped there has only its
    # speedup over its parent (`Tried.vs_parent`), and stock is timed from the remeasure on.
    reads_headlines: ClassVar[bool] = False

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    @abc.abstractmethod
    def propose(self, state: ExplorationState, n: int) -> list[Proposal]:
        """Up to `n` new stacks to try from `state`. An empty list means this proposer
        has nothing more to offer from this state (exhausted until the champion moves).
        Proposing a stack already in `state.tried` wastes nothing (the loop dedups before
        submitting) but counts against the proposer's patience."""

    def observe(self, proposal: Proposal, tried: Tried) -> None:
        """Told the outcome of one of its own proposals (Optuna's `tell`, say)."""
        return None  # a hook: a proposer that reads only the state ignores it
