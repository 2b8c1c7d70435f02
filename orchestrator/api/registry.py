"""Plugin discovery (entry points: families, then techniques) and stack validation.

Built-ins register through the same entry-point groups a third-party package uses, so there
is one path for both. Each plugin is loaded and checked against its contract on its own
(pluggy's lesson): one that fails to import, or claims a slot its family does not declare,
is listed as broken with the reason, and only the stacks that name it fail.

Validation runs before any model is built: unknown names, wrong family, bad params, slot
conflicts, ordering and device requirements all fail here with a
message that names the technique and the reason.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from pydantic import ValidationError

from orchestrate.api.config import StackSpec
from orchestrate.api.family import Family
from orchestrate.api.records import JobSpec
from orchestrate.api.technique import (
    PROFILE_COSTS,
    BuiltStack,
    DeviceCaps,
    Technique,
    TechniqueParams,
)

TECHNIQUES = "orchestrate.techniques"
FAMILIES = "orchestrate.families"


class StackError(ValueError):
    """A stack cannot be built; the message says which technique and why."""


@dataclass(frozen=True)
class Broken:
    """A plugin that failed to load or to validate: listed, never used."""

    group: str  # "technique" | "family"
    name: str
    target: str  # the entry point's "module:attr"
    error: str


@dataclass(frozen=True)
class Catalogue:
    families: dict[str, Family]
    techniques: dict[str, type[Technique]]
    broken: dict[tuple[str, str], Broken]  # (group, name) -> why


@cache
def catalogue() -> Catalogue:
    """Every installed family and technique, each validated on its own: a plugin that fails
    to import or breaks its contract is recorded as broken and the others stay usable."""
    broken: dict[tuple[str, str], Broken] = {}
    families: dict[str, Family] = {}
    for ep in entry_points(group=FAMILIES):
        try:
            families[ep.name] = _load_family(ep)
        except Exception as exc:  # a broken plugin must not hide the others
            broken["family", ep.name] = Broken("family", ep.name, ep.value, _why(exc))
    techniques: dict[str, type[Technique]] = {}
    for ep in entry_points(group=TECHNIQUES):
        try:
            cls = _load_technique(ep, families, broken)
        except Exception as exc:
            broken["technique", ep.name] = Broken("technique", ep.name, ep.value, _why(exc))
            continue
        if ep.name in techniques and techniques[ep.name] is not cls:
            why = f"two plugins register the technique {ep.name!r}"
            broken["technique", ep.name] = Broken("technique", ep.name, ep.value, why)
            del techniques[ep.name]
            continue
        techniques[ep.name] = cls
    return Catalogue(families, techniques, broken)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, StackError) else str(exc)


def _load_family(ep: EntryPoint) -> Family:
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, Family)):
        raise StackError(f"{ep.value} is not an orchestrate.api.family.Family subclass")
    if getattr(cls, "name", None) != ep.name:
        raise StackError(f"entry point {ep.name!r} points at a family named {cls.name!r}")
    if not getattr(cls, "slots", None):
        raise StackError(f"family {ep.name!r} declares no slots")
    return cls()


def _load_technique(
    ep: EntryPoint, families: dict[str, Family], broken: dict[tuple[str, str], Broken]
) -> type[Technique]:
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, Technique)):
        raise StackError(f"{ep.value} is not an orchestrate.api.technique.Technique subclass")
    if getattr(cls, "name", None) != ep.name:
        raise StackError(f"entry point {ep.name!r} points at a technique named {cls.name!r}")
    for attr, kind in (("family", str), ("exact", bool), ("version", int)):
        if not isinstance(getattr(cls, attr, None), kind):
            raise StackError(f"technique {ep.name!r}: {attr!r} must be a {kind.__name__}")
    if not (isinstance(cls.Params, type) and issubclass(cls.Params, TechniqueParams)):
        raise StackError(f"technique {ep.name!r}: Params must subclass TechniqueParams")
    if getattr(cls.apply, "__isabstractmethod__", False):
        raise StackError(f"technique {ep.name!r} does not implement apply()")
    if ("family", cls.family) in broken:
        why = broken["family", cls.family].error
        raise StackError(f"its family {cls.family!r} is broken ({why})")
    family = families.get(cls.family)
    if family is None:
        raise StackError(
            f"technique {ep.name!r} is for family {cls.family!r}, which is not installed "
            f"(installed: {', '.join(sorted(families)) or 'none'})"
        )
    for slot in (*cls.slots, *cls.wraps):
        if not family.declares(slot):
            raise StackError(
                f"technique {ep.name!r} claims slot {slot!r}, which family {cls.family!r} "
                f"does not declare (its slots: {', '.join(family.slots)})"
            )
    unknown = [c for c in cls.reduces if c not in PROFILE_COSTS]
    if not isinstance(cls.reduces, tuple) or unknown:
        raise StackError(
            f"technique {ep.name!r}: reduces {unknown or cls.reduces!r}; it names costs "
            f"of the profile: {', '.join(PROFILE_COSTS)}"
        )
    return cls


def discover() -> dict[str, type[Technique]]:
    """The usable techniques, by name."""
    return catalogue().techniques


def get(name: str) -> type[Technique]:
    cat = catalogue()
    if ("technique", name) in cat.broken:
        raise StackError(f"technique {name!r} is broken: {cat.broken['technique', name].error}")
    if name not in cat.techniques:
        known = ", ".join(sorted(cat.techniques))
        raise StackError(f"unknown technique {name!r}; known: {known}")
    return cat.techniques[name]


def get_family(name: str) -> Family:
    cat = catalogue()
    if ("family", name) in cat.broken:
        raise StackError(f"model family {name!r} is broken: {cat.broken['family', name].error}")
    if name not in cat.families:
        known = ", ".join(sorted(cat.families)) or "none installed"
        raise StackError(f"unknown model family {name!r}; known: {known}")
    return cat.families[name]


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
    get_family(spec.family)  # unknown or broken: say so before any technique
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
        for other in seen:  # declared on either side: graph_loop names cuda_graph only
            if other in cls.conflicts or ref.name in get(other).conflicts:
                raise StackError(f"technique {ref.name!r} conflicts with {other!r}")
        alone = next((t for t in [ref.name, *seen] if get(t).stands_alone), None)
        if alone is not None and seen:
            raise StackError(
                f"technique {alone!r} stands alone: it synthesises its own way, so the other "
                f"techniques of stack {spec.name!r} would not run"
            )
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

        why = _unmet(cls, params, caps) or _needs_skipped(cls, skipped)
        if why:
            if strict:
                raise StackError(f"technique {ref.name!r} cannot run here: {why}")
            skipped[ref.name] = why
            continue
        techniques.append(cls(params))
    return BuiltStack(spec, techniques, skipped)


def _unmet(cls: type[Technique], params: TechniqueParams, caps: DeviceCaps | None) -> str | None:
    if caps is None:
        return None
    reasons = [r for r in (caps.missing(req) for req in cls.requirements(params)) if r]
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


def source_hash(cls: type) -> str | None:
    """Short sha256 of the file that defines `cls` (for a package plugin, that module, not
    its siblings: the version and the distribution's version cover the rest). None when the
    class has no readable source file (a compiled module)."""
    try:
        path = inspect.getsourcefile(cls)
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path else None
    except (TypeError, OSError):
        return None


def technique_code(stacks: list[StackSpec]) -> dict[str, dict[str, str | int | None]]:
    """Per technique the stacks name: its version, the distribution that installed it, and
    its source hash, so a plugin edited without a version bump is a different experiment.
    Recorded in the job at planning (the stacks must already have been validated)."""
    names = sorted({t.name for s in stacks for t in s.techniques})
    return {name: _code_of(name) for name in names}


def _code_of(name: str) -> dict[str, str | int | None]:
    cls = get(name)
    dist = next((ep.dist for ep in entry_points(group=TECHNIQUES, name=name)), None)
    return {
        "version": cls.version,
        "dist": dist.name if dist else None,
        "dist_version": dist.version if dist else None,
        "source": source_hash(cls),
    }


def job_identity(job: JobSpec) -> str:
    """What makes two runs the same experiment: model, workload, stacks with technique
    versions and code, protocol, fidelity steps, the commit and any uncommitted changes.
    A repeated identity is not re-run unless forced.

    Everything comes from the job itself, so `ingest` on another host gets the identity the
    planning host saw. A job planned before technique code was recorded falls back to the
    versions of the plugins installed here."""
    code = job.technique_code or _installed_versions(job)
    blob = json.dumps(
        {
            "model": job.model.model_dump(mode="json"),
            "workload": job.workload.model_dump(mode="json"),
            "stacks": [s.model_dump(mode="json") for s in job.stacks],
            "techniques": code,
            "protocol": job.protocol.content_hash(),
            "code": job.code_sha,
            "dirty": job.code_dirty,
            "diff": job.code_diff_hash,
            "strict": job.strict,
            "fidelity_steps": job.fidelity_steps,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _installed_versions(job: JobSpec) -> dict[str, dict[str, str | int | None]]:
    known = discover()  # a result from a host with other plugins still gets an identity
    names = sorted({t.name for s in job.stacks for t in s.techniques})
    return {n: {"version": known[n].version if n in known else None} for n in names}
