"""Proposer plugins (entry-point group `orchestrate.proposers`), found and checked the way
api.registry finds techniques: each on its own, so one that fails to import or breaks the
contract is listed as broken with the reason, and only an exploration naming it fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from orchestrate.api.proposer import Proposer
from orchestrate.api.registry import Broken

PROPOSERS = "orchestrate.proposers"


class BadProposer(ValueError):
    """A proposer named on the command line is not installed, is broken, or refuses the
    options it was given."""


@dataclass(frozen=True)
class ProposerCatalogue:
    proposers: dict[str, type[Proposer]]
    broken: dict[str, Broken]


@cache
def proposer_catalogue() -> ProposerCatalogue:
    proposers: dict[str, type[Proposer]] = {}
    broken: dict[str, Broken] = {}
    for ep in entry_points(group=PROPOSERS):
        try:
            proposers[ep.name] = _load(ep)
        except Exception as exc:  # a broken plugin must not hide the others
            broken[ep.name] = Broken("proposer", ep.name, ep.value, f"{type(exc).__name__}: {exc}")
    return ProposerCatalogue(proposers, broken)


def _load(ep: EntryPoint) -> type[Proposer]:
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise TypeError(f"{ep.value} is not an orchestrate.api.proposer.Proposer subclass")
    if getattr(cls, "name", None) != ep.name:
        raise TypeError(f"entry point {ep.name!r} points at a proposer named {cls.name!r}")
    if getattr(cls.propose, "__isabstractmethod__", False):
        raise TypeError(f"proposer {ep.name!r} does not implement propose()")
    return cls


def default_names() -> list[str]:
    """Every usable proposer but `agent`, which needs a command to run."""
    return [n for n in sorted(proposer_catalogue().proposers) if n != "agent"]


def load_proposers(names: list[str], options: dict[str, dict[str, Any]]) -> list[Proposer]:
    """Instances of the named proposers, each with its options; BadProposer (one line)
    for a name that is not installed or is broken, or options it refuses."""
    cat = proposer_catalogue()
    out = []
    for name in names:
        if name in cat.broken:
            raise BadProposer(f"proposer {name!r} is broken: {cat.broken[name].error}")
        if name not in cat.proposers:
            known = ", ".join(sorted(cat.proposers)) or "none installed"
            raise BadProposer(f"unknown proposer {name!r}; known: {known}")
        try:
            out.append(cat.proposers[name](options.get(name)))
        except Exception as exc:  # its options, checked by the plugin itself
            raise BadProposer(f"proposer {name!r}: {exc}") from exc
    unused = sorted(set(options) - set(names))
    if unused:
        raise BadProposer(f"options given for proposers not in use: {', '.join(unused)}")
    return out
