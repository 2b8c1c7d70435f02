"""Sealed holdout prompts: read only by `orchestrate gate`, and every reading audited.

How the seal works:
- Holdout prompts live in configs/holdout/<workload>.yaml under a `sealed_holdout:` key, so
  the file is not a valid workload: `orchestrate run --workload configs/holdout/x.yaml`
  fails at load instead of quietly tuning on holdout prompts.
- `load_holdout` needs a live `HoldoutKey`. Keys come only from `with unseal("gate")`, and
  `unseal` checks who asks: the calling function must be one of SANCTIONED_READERS (the
  phase gate in orchestrator/gate.py). Any other caller - a tuning script, a
  notebook, a report - gets HoldoutSealed. A key dies when its `with` block ends.
- Every opening writes a holdout_audit row (stack, spec hash, lineage, time), closed later
  with the verdict. A stack whose spec, name or technique lineage already saw this holdout
  is flagged: re-tuning after seeing holdout results is how a holdout gets overfit.

None of this stops a determined person from reading a YAML file; it stops accidents, and it
makes every sanctioned look at the holdout visible in the database.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrate.api.config import CONFIG_DIR, ConfigError, Prompt, StackSpec, Workload
from orchestrate.api.protocol import phase_workload
from orchestrate.api.records import utcnow

if TYPE_CHECKING:
    from orchestrate.store.store import Store

HOLDOUT_DIR = CONFIG_DIR / "holdout"
# (module, function) allowed to unseal: the phase gate, nothing else.
SANCTIONED_READERS: frozenset[tuple[str, str]] = frozenset(
    {("orchestrate.research.gate", "run_gate")}
)
AuditStatus = Literal["accept", "retain", "error"]


class HoldoutSealed(PermissionError):
    """Holdout prompts were asked for outside the phase gate."""


class HoldoutError(ConfigError):
    """A holdout file is missing, malformed, or overlaps the development prompts."""


class _Sealed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    for_workload: str
    prompts: list[Prompt] = Field(min_length=1)
    seeds: list[int] | None = Field(None, description="Default: the development seeds.")


class _HoldoutFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sealed_holdout: _Sealed


# ---------------------------------------------------------------------------- the seal


@dataclass(eq=False)
class HoldoutKey:
    """Proof that the holder is inside `with unseal("gate")`; useless once it exits."""

    reason: str
    holder: str
    opened_at: datetime = field(default_factory=utcnow)
    live: bool = True


_LIVE: list[HoldoutKey] = []  # keys issued by unseal() and not yet closed


class unseal:
    """Open the holdout for the phase gate; raises HoldoutSealed for anyone else."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.key: HoldoutKey | None = None

    def __enter__(self) -> HoldoutKey:
        caller = sys._getframe(1)
        holder = (str(caller.f_globals.get("__name__")), caller.f_code.co_name)
        if self.reason != "gate" or holder not in SANCTIONED_READERS:
            raise HoldoutSealed(
                f"holdout prompts are sealed: only `orchestrate gate` reads them "
                f"(asked by {holder[0]}.{holder[1]} with reason {self.reason!r}); tune on the "
                "development prompts and submit the stack to `orchestrate gate`"
            )
        self.key = HoldoutKey(self.reason, f"{holder[0]}.{holder[1]}")
        _LIVE.append(self.key)
        return self.key

    def __exit__(self, *exc: object) -> None:
        if self.key is not None:
            self.key.live = False
            _LIVE.remove(self.key)


def _check(key: HoldoutKey | None) -> None:
    if key is None or not key.live or not any(k is key for k in _LIVE):
        raise HoldoutSealed(
            "holdout prompts are sealed: reading them needs the live key of "
            "`with unseal('gate')`, which only `orchestrate gate` holds"
        )


# ---------------------------------------------------------------------------- loading


def holdout_path(workload_name: str) -> Path:
    return HOLDOUT_DIR / f"{workload_name}.yaml"


def load_holdout(
    dev: Workload, key: HoldoutKey | None, path: Path | None = None
) -> tuple[Workload, str]:
    """The holdout workload for development workload `dev`, and the holdout's hash.

    It shares `dev`'s voice, sampling and length policy (so only the prompts differ), is
    named '<dev>@holdout', keeps every recording (all are scored) and warms up at least once.
    """
    _check(key)
    path = path or holdout_path(dev.name)
    if not path.exists():
        raise HoldoutError(f"no holdout prompts for workload {dev.name!r}: {path} is missing")
    try:
        sealed = _HoldoutFile.model_validate(yaml.safe_load(path.read_text())).sealed_holdout
    except (ValidationError, yaml.YAMLError) as exc:
        raise HoldoutError(f"{path}: not a sealed holdout file: {exc}") from exc
    if sealed.for_workload != dev.name:
        raise HoldoutError(f"{path} is sealed for {sealed.for_workload!r}, not {dev.name!r}")
    _refuse_overlap(dev, sealed.prompts, path)
    seeds = sealed.seeds or dev.seeds
    data = dev.model_dump() | {
        "name": phase_workload(dev.name, "holdout"),
        "prompts": [p.model_dump() for p in sealed.prompts],
        "seeds": seeds,
        "warmups": max(1, dev.warmups),
        "save_audio": len(sealed.prompts) * len(seeds),
    }
    blob = json.dumps(data["prompts"] + [seeds], sort_keys=True)
    return Workload.model_validate(data), hashlib.sha256(blob.encode()).hexdigest()[:16]


def _refuse_overlap(dev: Workload, prompts: list[Prompt], path: Path) -> None:
    from orchestrate.api.scoring import normalize_text

    dev_ids = {p.id for p in dev.prompts}
    dev_texts = {normalize_text(p.text): p.id for p in dev.prompts}
    clashes = [
        f"{p.id} (id)" if p.id in dev_ids else f"{p.id} = dev {dev_texts[normalize_text(p.text)]}"
        for p in prompts
        if p.id in dev_ids or normalize_text(p.text) in dev_texts
    ]
    if clashes:
        raise HoldoutError(f"{path}: holdout prompts overlap development prompts: {clashes}")


# ------------------------------------------------------------------------------ audit


def lineage(stack: StackSpec) -> str:
    """Family and technique names in order: what stays the same when a stack is re-tuned."""
    return stack.family + ":" + ">".join(t.name for t in stack.techniques)


@dataclass(frozen=True)
class Opened:
    audit_id: int
    flags: list[str]


def open_audit(
    store: Store,
    key: HoldoutKey,
    workload_name: str,
    holdout_hash: str,
    stack: StackSpec,
    protocol_hash: str,
) -> Opened:
    """Record that `stack` is about to see the holdout; flag it if it (or an earlier tuning
    of it) has seen this holdout before."""
    _check(key)
    spec_hash, line = stack.content_hash(), lineage(stack)
    audit_id, flags = store.open_holdout_audit(
        workload_name=workload_name,
        holdout_hash=holdout_hash,
        stack_name=stack.name,
        stack_hash=spec_hash,
        lineage=line,
        protocol_hash=protocol_hash,
        holder=key.holder,
        flag=lambda prior: _flags(prior, stack.name, spec_hash, line),
    )
    return Opened(audit_id, flags)


def _flags(prior: list[dict[str, Any]], name: str, spec_hash: str, line: str) -> list[str]:
    """Flags against a stack (name, spec hash, lineage) from earlier openings (audit rows)."""
    flags = []
    for p in prior:
        when = f"{p['opened_at']:%Y-%m-%d %H:%M} ({p['status']})"
        if p["stack_hash"] == spec_hash:
            flags.append(f"re-submitted: this exact stack already saw this holdout at {when}")
        elif p["stack_name"] == name or p["lineage"] == line:
            flags.append(
                f"re-tuned after seeing holdout: {p['stack_name']} ({p['stack_hash']}, "
                f"techniques {p['lineage']}) saw this holdout at {when}"
            )
    return list(dict.fromkeys(flags))


def close_audit(
    store: Store,
    audit_id: int,
    status: AuditStatus,
    run_id: str | None,
    detail: dict[str, Any],
) -> None:
    """Close an opening with the gate's verdict (or 'error') and the run that saw it."""
    store.close_holdout_audit(audit_id, status, run_id, detail)


def list_audits(store: Store, workload_name: str | None = None) -> list[dict[str, Any]]:
    """Holdout openings, oldest first."""
    return store.list_holdout_audits(workload_name)
