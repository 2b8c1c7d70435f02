"""Technique discovery (entry points) and stack validation.

Built-ins register through the same entry-point group a third-party package uses, so there
is one path for both. Validation runs before any model is built: unknown names, wrong
family, bad params, slot conflicts, ordering and device requirements all fail here with a
message that names the technique and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points

from pydantic import ValidationError

from orchestrator.config import StackSpec
from orchestrator.technique import DeviceCaps, Technique, TechniqueParams

GROUP = "orchestrate.techniques"


class StackError(ValueError):
    """A stack cannot be built; the message says which technique and why."""


@cache
def discover() -> dict[str, type[Technique]]:
    found: dict[str, type[Technique]] = {}
    for ep in entry_points(group=GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must not hide the others
            raise StackError(
                f"technique plugin {ep.name!r} ({ep.value}) failed to import: {exc}"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Technique)):
            raise StackError(f"entry point {ep.name!r} ({ep.value}) is not a Technique subclass")
        if cls.name != ep.name:
            raise StackError(f"entry point {ep.name!r} points at technique named {cls.name!r}")
        if ep.name in found and found[ep.name] is not cls:
            raise StackError(f"two plugins register the technique {ep.name!r}")
        found[ep.name] = cls
    return found


def get(name: str) -> type[Technique]:
    known = discover()
    if name not in known:
        raise StackError(f"unknown technique {name!r}; known: {', '.join(sorted(known))}")
    return known[name]


@dataclass
class BuiltStack:
    spec: StackSpec
    techniques: list[Technique]
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why (device lacks it)

    @property
    def exact(self) -> bool:
        return all(t.exact for t in self.techniques)

    @property
    def partial(self) -> bool:
        return bool(self.skipped)


def build_stack(
    spec: StackSpec, caps: DeviceCaps | None = None, strict: bool = False
) -> BuiltStack:
    """Validate `spec` and instantiate its techniques in order.

    With `caps`, techniques whose requirements the device lacks are skipped (recorded with
    the reason, the run becomes partial) or, with `strict`, refused. Techniques that need a
    skipped one are skipped too, never applied half-configured.
    """
    techniques: list[Technique] = []
    skipped: dict[str, str] = {}
    claimed: dict[str, str] = {}  # slot -> technique
    seen: list[str] = []
    accepted: dict[str, TechniqueParams] = {}
    for ref in spec.techniques:
        cls = get(ref.name)
        if cls.family != spec.family:
            raise StackError(
                f"technique {ref.name!r} is for the {cls.family!r} family; stack "
                f"{spec.name!r} is {spec.family!r}"
            )
        try:
            params = cls.Params.model_validate(ref.params)
        except ValidationError as exc:
            raise StackError(f"technique {ref.name!r}: bad params: {_explain(exc)}") from exc
        for other in cls.conflicts:
            if other in seen:
                raise StackError(f"technique {ref.name!r} conflicts with {other!r}")
        for slot in cls.slots:
            if slot in claimed:
                raise StackError(
                    f"techniques {claimed[slot]!r} and {ref.name!r} both fill the "
                    f"{slot!r} slot; keep one"
                )
            claimed[slot] = ref.name
        for before in cls.after:
            if before not in seen:
                where = "later in" if before in _names(spec) else "missing from"
                raise StackError(
                    f"technique {ref.name!r} needs {before!r} applied before it "
                    f"({before!r} is {where} the stack)"
                )
        if why_not := cls.check_stack(params, dict(accepted)):
            raise StackError(f"technique {ref.name!r}: {why_not}")
        accepted[ref.name] = params
        seen.append(ref.name)

        why = _unmet(cls, caps) or _needs_skipped(cls, skipped)
        if why:
            if strict:
                raise StackError(f"technique {ref.name!r} cannot run here: {why}")
            skipped[ref.name] = why
            continue
        techniques.append(cls(params))
    return BuiltStack(spec, techniques, skipped)


def _unmet(cls: type[Technique], caps: DeviceCaps | None) -> str | None:
    if caps is None:
        return None
    reasons = [r for r in (caps.missing(req) for req in cls.requires) if r]
    return "; ".join(reasons) or None


def _needs_skipped(cls: type[Technique], skipped: dict[str, str]) -> str | None:
    missing = [b for b in cls.after if b in skipped]
    return f"needs {', '.join(missing)}, which was skipped" if missing else None


def _names(spec: StackSpec) -> list[str]:
    return [t.name for t in spec.techniques]


def _explain(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()
    )
