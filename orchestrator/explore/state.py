"""What proposers are shown: the exploration's state as plain data (api.proposer's
ExplorationState), built from its candidate rows, the technique catalogue and the device.

Nothing here reads a holdout or hands out the store: a proposer sees dev measurements,
decisions and reasons, and the catalogue, which is also all an external agent gets.
"""

from __future__ import annotations

from typing import Any

from orchestrate.api.config import StackSpec
from orchestrate.api.proposer import ExplorationState, Tried
from orchestrate.api.records import StackResult
from orchestrate.api.registry import catalogue
from orchestrate.api.technique import HOST, DeviceCaps
from orchestrate.explore import jobs

PROFILE_PREFIX = "slot_ms."  # per-slot time of a stack, where the worker measured it
HOST_WALL, GPU_BUSY = "ms_per_token", "gpu_busy_ms_per_step"  # a step is a token here


def technique_catalogue(family: str) -> dict[str, dict[str, Any]]:
    """This family's usable techniques, as proposers read them. An exploration compares
    per-utterance speed, so techniques that serve many streams (serving workloads only),
    and those that only such a technique reads (fp8_projections), are not offered."""
    techniques = catalogue().techniques
    serving = {n for n, cls in techniques.items() if cls.serves_streams}
    return {
        name: {
            "summary": cls.summary,
            "exact": cls.exact,
            "version": cls.version,
            "slots": list(cls.slots),
            "wraps": list(cls.wraps),
            "requires": list(cls.requires),
            "after": list(cls.after),
            "conflicts": list(cls.conflicts),
            "reduces": list(cls.reduces),
            "params_schema": cls.Params.model_json_schema(),
        }
        for name, cls in sorted(techniques.items())
        if cls.family == family and name not in serving and not serving & set(cls.after)
    }


def device_caps(device: str, techniques: dict[str, dict[str, Any]]) -> list[str]:
    """The requirements named by `techniques` that this device meets ("cuda", "sm90",
    "package:triton", ...), plus the device kind."""
    probe = DeviceCaps.probe(device)
    wanted = sorted({r for meta in techniques.values() for r in meta["requires"]})
    met = [r for r in wanted if _met(probe, r)]
    return sorted({probe.kind, *met})


def _met(probe: DeviceCaps, requirement: str) -> bool:
    try:
        return probe.missing(requirement) is None
    except ValueError:  # a requirement this version does not know: not met
        return False


def profile_of(result: StackResult | None) -> dict[str, float]:
    """slot -> ms per step of a stack, from its `slot_ms.*` metrics ({} when unmeasured),
    and `host`: the ms per step the GPU sat idle (wall ms per token minus GPU-busy ms per
    token, where the job counted the stack's kernels). The slot timers cannot say this:
    they synchronise around each slot, so a slot's time is its launches and its kernels
    together. For stock on the H200 the GPU was busy 4.7 of 26.3 ms a token."""
    if result is None:
        return {}
    m = result.metrics
    out = {
        key.removeprefix(PROFILE_PREFIX): value
        for key, value in m.items()
        if key.startswith(PROFILE_PREFIX)
    }
    if out and HOST_WALL in m and GPU_BUSY in m:
        out[HOST] = max(0.0, m[HOST_WALL] - m[GPU_BUSY])
    return out


def describe_profile(profile: dict[str, float]) -> str:
    """One line for the log: each entry's ms per step, costliest first."""
    if not profile:
        return "not measured (no slot timings)"
    slots = sorted(((k, v) for k, v in profile.items() if k != HOST), key=lambda kv: -kv[1])
    text = "slots " + ", ".join(f"{k} {v:.3g} ms" for k, v in slots) + " per step"
    if HOST in profile:
        text = f"{HOST} {profile[HOST]:.3g} ms (the GPU idle); " + text
    return text


def tried_of(candidates: list[dict[str, Any]]) -> list[Tried]:
    """Decided candidates that named a stack, as proposers see them (oldest first)."""
    out = []
    for c in candidates:
        if c["status"] != "decided" or c["spec"] is None:
            continue
        out.append(
            Tried(
                stack=jobs.stored_stack(c["spec"]),
                change=c["change"],
                proposer=c["proposer"],
                decision=c["decision"],
                reason=c["reason"] or "",
                headline=c["headline"],
                headline_lo=c["headline_lo"],
                headline_hi=c["headline_hi"],
                vs_parent=c["vs_parent"],
                vs_parent_hi=c["vs_parent_hi"],
            )
        )
    return out


def cut_by_budget(cand: dict[str, Any]) -> bool:
    """The budget stopped the candidate on its way to its next phase."""
    steps = cand.get("steps") or []
    return bool(steps) and steps[-1]["phase"] == "budget"


def build_state(
    exploration: dict[str, Any],
    candidates: list[dict[str, Any]],
    caps: list[str],
    techniques: dict[str, dict[str, Any]],
    profile: dict[str, float],
) -> ExplorationState:
    """The state of `exploration` (a store row) for its proposers."""
    return ExplorationState(
        family=exploration["family"],
        device=exploration["model"]["device"],
        device_caps=caps,
        champion=StackSpec.model_validate(exploration["champion"]),
        champion_headline=exploration["champion_headline"],
        root=StackSpec.model_validate(exploration["root"]),
        min_speedup=exploration["protocol"]["speed"]["min_speedup"],
        catalogue=techniques,
        # One the budget cut before it was judged says nothing: its stack may be proposed
        # again (on the H200 the cut +decode_attention +pdl kept +pdl from the next champion).
        tried=tried_of([c for c in candidates if not cut_by_budget(c)]),
        profile=profile,
        pending=[
            jobs.stored_stack(c["spec"])
            for c in candidates
            if c["status"] == "open" and c["spec"] is not None
        ],
    )
