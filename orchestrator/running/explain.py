"""`orchestrate explain STACK`: which function fills each slot of a family's engine.

The page a reader opens instead of seven technique files. What it prints is read off an
engine really built for the stack (the family's small preset on this machine by default),
not from what techniques say about themselves: each slot's occupant is located with
`inspect` as `file:function`. A technique this device cannot apply is listed with the
reason and where its `apply` lives, and its slots show stock's occupant.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orchestrate.api.config import REPO_ROOT, ModelSpec, StackSpec
from orchestrate.api.registry import build_stack, get, get_family
from orchestrate.api.technique import BuiltStack, DeviceCaps, Technique


@dataclass
class SlotLine:
    slot: str
    stock: str  # file:function of stock's occupant
    filled_by: str | None  # technique name, or None when stock fills it
    occupant: str  # file:function of what fills it in this stack
    exact: bool | None  # the technique's declared exactness (measured in runs, not here)
    requires: list[str] = field(default_factory=list)


@dataclass
class Explanation:
    stack: str
    family: str
    model: str
    device: str
    slots: list[SlotLine]
    skipped: dict[str, str]  # technique -> why this device cannot apply it
    techniques: list[dict[str, Any]]  # name, version, exact, slots, wraps, apply location


def locate(obj: Any) -> str:
    """`path/to/file.py:line:qualname` of a function, method, partial or callable object;
    a plain value (a decoding knob) as its repr."""
    if not callable(obj) and not hasattr(obj, "__dict__"):
        return f"= {obj!r}"
    while isinstance(obj, functools.partial):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)  # bound method -> function
    obj = inspect.unwrap(obj) if callable(obj) else obj
    target = obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
    try:
        path = Path(inspect.getsourcefile(target) or "?")
        line = inspect.getsourcelines(target)[1]
    except (TypeError, OSError):
        return f"{getattr(target, '__module__', '?')}:{target.__qualname__}"
    if path.resolve().is_relative_to(REPO_ROOT):  # a third-party plugin keeps its full path
        path = path.resolve().relative_to(REPO_ROOT)
    return f"{path}:{line}:{target.__qualname__}"


@torch.no_grad()  # as the worker builds engines: no autograd history kept
def explain(spec: StackSpec, model: ModelSpec) -> Explanation:
    """Build stock's engine and the stack's engine for `model` and compare slot by slot."""
    family = get_family(spec.family)
    if model.family != spec.family:
        raise ValueError(
            f"stack {spec.name!r} is for the {spec.family!r} family; model preset "
            f"{model.preset!r} is {model.family!r}"
        )
    built: BuiltStack = build_stack(spec, DeviceCaps.probe(model.device))
    built_model = family.build_model(model)
    stock = family.slot_occupants(family.build_engine(built_model, build_stack(_empty(spec))))
    engine = family.build_engine(built_model, built)
    ours = family.slot_occupants(engine)
    filled: dict[str, Technique] = {}
    for technique in built.techniques:
        for slot in (*technique.slots, *technique.wraps):
            filled[slot] = technique
    lines = []
    for slot in sorted(set(stock) | set(ours), key=_slot_order(family.slots)):
        tech = filled.get(slot)
        lines.append(
            SlotLine(
                slot=slot,
                stock=locate(stock[slot]) if slot in stock else "-",
                filled_by=tech.name if tech else None,
                occupant=locate(ours[slot]) if slot in ours else "-",
                exact=tech.exact if tech else None,
                requires=list(tech.requires) if tech else [],
            )
        )
    techniques = [
        {
            "name": ref.name,
            "version": cls.version,
            "exact": cls.exact,
            "slots": list(cls.slots),
            "wraps": list(cls.wraps),
            "requires": list(cls.requires),
            "apply": locate(cls.apply),
            "applied": ref.name not in built.skipped,
        }
        for ref, cls in ((r, get(r.name)) for r in spec.techniques)
    ]
    return Explanation(
        spec.name, spec.family, model.preset, model.device, lines, dict(built.skipped), techniques
    )


def _empty(spec: StackSpec) -> StackSpec:
    return spec.model_copy(update={"name": "stock", "techniques": []})


def _slot_order(declared: tuple[str, ...]):
    order = {s: i for i, s in enumerate(declared)}
    return lambda slot: (order.get(slot, len(order)), slot)
