"""Sealed holdout prompts: read only by `orchestrate gate`, and every reading audited.

How the seal works:
- Holdout prompts live in configs/holdout/<workload>.yaml under a `sealed_holdout:` key, so
  the file is not a valid workload: `orchestrate run --workload configs/holdout/x.yaml`
  fails at load instead of quietly tuning on holdout prompts.
- `load_holdout` needs a live `HoldoutKey`. Keys come only from `with unseal("gate")`, and
  `unseal` checks who asks: the calling function must be one of SANCTIONED_READERS (the
  phase gate in orchestrator/research/gate.py). Any other caller - a tuning script, a
  notebook, a report - gets HoldoutSealed. A key dies when its `with` block ends.
- Every opening writes a holdout_audit row (stack, spec hash, lineage, time), closed later
  with the verdict. A stack whose spec, name or technique lineage already saw this holdout
  is flagged: re-tuning after seeing holdout results is how a holdout gets overfit.
- The workload `load_holdout` hands the gate carries placeholders, not texts: the texts are
  written nowhere but the sealed file (job.json, result.json, the database and MLflow keep
  ids and hashes); the worker and the scorers read them back (orchestrate.api.sealed).
- Any other plan holding a holdout text or a near copy of one is refused by `plan_job`
  (HoldoutLeak); `audit_refusal` records the refusal in holdout_audit.

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

from orchestrate.api import sealed as sealing
from orchestrate.api.config import ConfigError, Prompt, StackSpec, Workload
from orchestrate.api.protocol import phase_workload, split_phase
from orchestrate.api.records import utcnow

if TYPE_CHECKING:
    from orchestrate.store.store import Store

HOLDOUT_DIR = sealing.HOLDOUT_DIR
# (module, function) allowed to unseal: the phase gate, nothing else.
SANCTIONED_READERS: frozenset[tuple[str, str]] = frozenset(
    {("orchestrate.research.gate", "run_gate")}
)
AuditStatus = Literal["accept", "retain", "error"]


class HoldoutSealed(PermissionError):
    """Holdout prompts were asked for outside the phase gate."""


class HoldoutError(ConfigError):
    """A holdout file is missing, malformed, or overlaps the development prompts."""


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
    Its prompts are placeholders (api.sealed.seal): plan it with `sealed_file=path`.
    """
    _check(key)
    path = path or holdout_path(dev.name)
    if not path.exists():
        raise HoldoutError(f"no holdout prompts for workload {dev.name!r}: {path} is missing")
    try:
        sealed = sealing.read_sealed(path)
    except sealing.SealedError as exc:
        raise HoldoutError(str(exc)) from exc
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
    # Hashed over the clear texts, as before placeholders: the audit's holdout identity.
    blob = json.dumps(data["prompts"] + [seeds], sort_keys=True)
    held = sealing.seal(Workload.model_validate(data))
    return held, hashlib.sha256(blob.encode()).hexdigest()[:16]


def _refuse_overlap(dev: Workload, prompts: list[Prompt], path: Path) -> None:
    """Holdout prompts sharing an id with, or copying (api.sealed.match), a dev prompt."""
    dev_ids = {p.id for p in dev.prompts}
    held = [sealing.Fingerprint.of(str(path), p) for p in prompts]
    clashes = [f"{p.id} (id)" for p in prompts if p.id in dev_ids] + [
        f"{leak.holdout_id} = dev {leak.prompt_id} ({leak.how})"
        for leak in sealing.find_leaks(dev, held)
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


def audit_refusal(store: Store, exc: sealing.HoldoutLeak, holder: str) -> int:
    """Record a plan refused for holding holdout text (closed at once, status 'error', no
    run); `holder` names the command. Returns the audit id.

    The row is keyed by the refused workload (its development name: 'smoke' for the gate's
    'smoke@remeasure') and the first matched holdout prompt's digest, never a holdout's
    hash, so it is no earlier opening of any holdout to flag a stack by.
    """
    first, stack = exc.leaks[0], exc.stacks[-1]  # the last stack listed: the candidate
    return store.record_holdout_refusal(
        workload_name=split_phase(exc.workload)[0],
        holdout_hash=first.holdout_digest,
        stack_name=stack.name,
        stack_hash=stack.content_hash(),
        lineage=lineage(stack),
        protocol_hash=exc.protocol_hash,
        detail={
            "holder": holder,
            "workload": exc.workload,
            "outcome": exc.outcome(first),
            "matches": [
                {
                    "outcome": exc.outcome(leak),
                    "how": leak.how,
                    "holdout_file": leak.holdout_file,
                    "holdout_digest": leak.holdout_digest,
                }
                for leak in exc.leaks
            ],
            "stacks": [s.name for s in exc.stacks],
        },
    )


def list_audits(store: Store, workload_name: str | None = None) -> list[dict[str, Any]]:
    """Holdout openings, oldest first."""
    return store.list_holdout_audits(workload_name)
