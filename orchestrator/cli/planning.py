"""Options of `run` and `submit` -> a planned job: one place, so a job queued for a pool is
refused for exactly what `run` refuses, before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from orchestrate.api.config import (
    EXPERIMENTS_DIR,
    ConfigError,
    StackSpec,
    explain,
    load_model_spec,
    load_stack,
    load_workload,
    stack_path,
)
from orchestrate.api.protocol import ProtocolError, load_protocol
from orchestrate.api.registry import StackError, get_family
from orchestrate.cli.common import fail, open_store

# The options of a job, shared by `run` and `submit` (one definition, one help text).
StackOpt = Annotated[
    list[str] | None,
    typer.Option("--stack", "-s", help="Stack name (experiments/) or YAML path; repeatable."),
]
BaselineOpt = Annotated[
    str | None,
    typer.Option(help="Stack every other stack is compared against (default: the family's)."),
]
ModelOpt = Annotated[
    str, typer.Option(help="Model preset (configs/models/) or a local weights folder.")
]
WorkloadOpt = Annotated[
    str | None,
    typer.Option(help="Workload name (configs/workloads/) or YAML path (default: family's)."),
]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu or cuda (default: the model preset's).")]
DtypeOpt = Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")]
StrictOpt = Annotated[
    bool, typer.Option(help="Refuse techniques this device lacks instead of skipping them.")
]
PrefixesOpt = Annotated[
    bool, typer.Option(help="Also run every cumulative prefix of each --stack.")
]
ForceOpt = Annotated[
    bool, typer.Option(help="Re-run even if this exact experiment already finished.")
]
FidelityOpt = Annotated[
    int, typer.Option(help="Teacher-forced steps compared against stock (0: off).")
]


def plan_cli_job(
    stack: list[str] | None,
    baseline: str | None,
    model: str,
    workload: str | None,
    device: str | None,
    dtype: str | None,
    strict: bool,
    prefixes: bool,
    fidelity_steps: int,
    protocol: str,
    runs_dir: Path,
    db: str | None,
    command: str,
    check_device: bool = True,
) -> tuple[Any, Any]:
    """`run`'s and `submit`'s options -> a planned job and the store; every refusal is one
    line and exit 2, before anything is written (a holdout leak is audited). `check_device`:
    False for a job queued for another machine's worker (which checks its device)."""
    from pydantic import ValidationError

    from orchestrate.api.sealed import HoldoutLeak
    from orchestrate.research.holdout import audit_refusal
    from orchestrate.running.plan import plan_job, prefix_stack

    if not stack:
        fail("missing option --stack (name the stacks to measure, or --resume RUN)")
    try:
        _check_options(device=device, dtype=dtype, fidelity_steps=fidelity_steps)
        spec = load_model_spec(model, device=device, dtype=dtype)
        family = get_family(spec.family)
        work = load_workload(workload or family.workload)
        if baseline is None:  # a serving workload's stacks all serve: so must its baseline
            baseline = family.serving_baseline if work.load else family.baseline
        if baseline is None:
            raise ConfigError(
                f"workload {work.name!r} serves many streams and the {family.name} family "
                "names no serving baseline: give one with --baseline"
            )
        stacks = [load_stack(baseline)]
        for name in stack:
            candidate = load_stack(name)
            is_baseline = candidate.name == stacks[0].name
            if is_baseline:  # the baseline listed again is measured once, as the baseline
                _same_as_baseline(candidate, name, stacks[0], baseline)
            else:
                _no_shadowing(candidate, name)
            if prefixes:
                stacks += [prefix_stack(candidate, n) for n in range(1, len(candidate.techniques))]
            if not is_baseline:
                stacks.append(candidate)
        job = plan_job(
            spec,
            work,
            stacks,
            load_protocol(protocol),
            runs_dir,
            strict=strict,
            fidelity_steps=fidelity_steps,
            check_device=check_device,
        )
    except HoldoutLeak as exc:  # a holdout text in the workload: refused, and audited
        audit_refusal(open_store(db), exc, command)
        fail(str(exc))
    except ValidationError as exc:  # a ValueError too: never show pydantic's text and URLs
        fail(explain(exc))
    except (ConfigError, StackError, ValueError) as exc:
        fail(str(exc))
    store = open_store(db)
    try:  # as the gate does: a protocol edited in place under a recorded version is refused
        store.register_protocol(job.protocol)
    except ProtocolError as exc:
        fail(str(exc))
    return job, store


DTYPES = ("float32", "bfloat16", "float16")


def _check_options(device: str | None, dtype: str | None, fidelity_steps: int) -> None:
    """Options checked here, in the CLI's words, before they reach a pydantic model."""
    if device not in (None, "cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
    if dtype not in (None, *DTYPES):
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fidelity_steps < 0:
        raise ConfigError(f"--fidelity-steps must be >= 0, got {fidelity_steps}")


def _same_as_baseline(candidate: StackSpec, name: str, base: StackSpec, base_name: str) -> None:
    """A --stack named like the baseline is the baseline only if it applies the same
    techniques; otherwise one of them would be dropped without a word."""
    if (candidate.family, candidate.techniques) != (base.family, base.techniques):
        raise ConfigError(
            f"stack {candidate.name!r} from {stack_path(name)} has the baseline's name but "
            f"other techniques than the baseline {base.name!r} from {stack_path(base_name)}; "
            "rename one of them"
        )


def _no_shadowing(candidate: StackSpec, name: str) -> None:
    """A stack from a file may not take a built-in stack's name with other techniques: its
    runs would be listed, diffed and gated as the built-in one."""
    builtin = EXPERIMENTS_DIR / f"{candidate.name}.yaml"
    if not builtin.is_file() or stack_path(name).resolve() == builtin.resolve():
        return
    known = load_stack(str(builtin))
    if (known.family, known.techniques) != (candidate.family, candidate.techniques):
        raise ConfigError(
            f"stack {candidate.name!r} from {name} reuses the name of the built-in stack "
            f"{builtin.relative_to(EXPERIMENTS_DIR.parent)} with other techniques; rename it"
        )
