"""What a technique plugin is: a versioned params model, metadata, and one `apply`.

A plugin author writes one module:

    class MyParams(TechniqueParams):
        block: int = 64

    class MyTechnique(Technique):
        name = "my_technique"
        family = "rumik"
        exact = True                      # must match stock teacher-forced logits
        slots = ("head",)                 # slots it fills exclusively
        summary = "one line for `orchestrate techniques`"
        Params = MyParams

        def apply(self, engine):          # replace only the declared slots
            engine.head = ...

and one entry-point line in its pyproject.toml:

    [project.entry-points."orchestrate.techniques"]
    my_technique = "my_package.my_module:MyTechnique"
"""

from __future__ import annotations

import abc
import importlib.util
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from orchestrate.api.config import StackSpec, Workload

# Profile entries that are not slots: `Technique.reduces` may name only these. HOST: the
# time per step the GPU sits idle (explore.state.profile_of).
HOST = "host"
PROFILE_COSTS = (HOST,)


class Refused(RuntimeError):
    """Raised by `apply` when a technique finds it cannot run on this model or package
    version: the stack is recorded as refused, with this reason, rather than crashed."""


class UnsupportedConfig(Refused, ValueError):
    """The model (or its shapes) is outside what a technique's kernels support; the message
    names the limit."""


class TechniqueParams(BaseModel):
    """Base for a technique's parameters; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Technique(abc.ABC):
    name: ClassVar[str]
    version: ClassVar[int] = 1  # bump when behaviour or params change meaning
    family: ClassVar[str]
    exact: ClassVar[bool]
    summary: ClassVar[str] = ""
    slots: ClassVar[tuple[str, ...]] = ()  # filled exclusively: two claimants conflict
    wraps: ClassVar[tuple[str, ...]] = ()  # wrapped around whatever fills the slot
    requires: ClassVar[tuple[str, ...]] = ()  # "cuda", "sm90", "package:<import name>"
    after: ClassVar[tuple[str, ...]] = ()  # techniques that must be applied earlier
    conflicts: ClassVar[tuple[str, ...]] = ()
    # Costs outside any one slot that the technique exists to cut, named as the exploration's
    # profile names them (PROFILE_COSTS): "host" is the time per step the GPU sits idle
    # while the host runs Python and launches kernels, which capturing the step removes.
    # It orders proposals (the `profile` proposer); what a technique really cuts is measured.
    reduces: ClassVar[tuple[str, ...]] = ()
    # True for a technique that replaces the whole synthesis with a path of its own (a
    # library's generate()), so no other technique's slot would be used: it is refused in
    # any stack with others rather than measured as if they ran.
    stands_alone: ClassVar[bool] = False
    # True for a technique that makes the engine serve many streams at once (a batched
    # server): it belongs only in stacks run on a serving workload (one with a `load:`),
    # and a serving workload's stacks each need one (running/plan.py refuses both mistakes).
    serves_streams: ClassVar[bool] = False
    Params: ClassVar[type[TechniqueParams]] = TechniqueParams

    def __init__(self, params: TechniqueParams):
        self.params = params

    @classmethod
    def check_stack(
        cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]
    ) -> str | None:
        """Why this technique cannot follow `earlier` (name -> params) with these params.

        For conflicts that depend on parameters, e.g. two ways of capturing one graph.
        """
        return None

    @classmethod
    def requirements(cls, params: TechniqueParams) -> tuple[str, ...]:
        """What it needs with these params: `requires`, and more where a parameter picks a
        kernel (a Triton path needs "cuda"); checked when the stack is planned, before any
        model is built."""
        return cls.requires

    @classmethod
    def check_workload(cls, params: TechniqueParams, workload: Workload) -> str | None:
        """Why this technique cannot run `workload` with these params (a serving load
        beyond its rows, say); checked when the job is planned, before any model is built."""
        return None

    @abc.abstractmethod
    def apply(self, engine: Any) -> None:
        """Replace (or wrap) the declared slots of `engine`, and nothing else."""

    @classmethod
    def ref(cls) -> str:
        return f"{cls.name}@{cls.version}"


def beyond_rows(workload: Workload, rows: int, streams: str, row_name: str) -> str | None:
    """For a serving technique's `check_workload`: one line when the load has more
    concurrent `streams` (the family's word: streams, requests) than its `rows`."""
    load = workload.load
    if load is not None and load.sustained and load.sustained > rows:
        return (
            f"a sustained {load.sustained} live {streams} exceed its {rows} {row_name} "
            "(raise rows: or lower sustained)"
        )
    if load is None or not load.concurrency or load.concurrency <= rows:
        return None
    return (
        f"{load.concurrency} concurrent {streams} exceed its {rows} {row_name} (raise rows: "
        "or lower the concurrency)"
    )


@dataclass(frozen=True)
class DeviceCaps:
    """What the device a stack will run on offers; requirements are checked against it."""

    kind: str  # "cpu" | "cuda"
    capability: tuple[int, int] | None = None
    name: str = "cpu"

    @classmethod
    def probe(cls, device: str) -> DeviceCaps:
        if device != "cuda":
            return cls("cpu")
        import torch  # here, not at the top: listing or checking stacks needs no torch (3 s)

        if torch.cuda.is_available():
            return cls("cuda", torch.cuda.get_device_capability(), torch.cuda.get_device_name())
        return cls("cpu")

    def missing(self, requirement: str) -> str | None:
        """None when met, else why not."""
        if requirement == "cuda":
            return None if self.kind == "cuda" else "needs a CUDA device (running on the CPU)"
        if requirement == "sm90":
            if self.kind != "cuda" or self.capability is None:
                return "needs a Hopper GPU (sm_90); running on the CPU"
            if self.capability < (9, 0):
                major, minor = self.capability
                return f"needs a Hopper GPU (sm_90); {self.name} is sm_{major}{minor}"
            return None
        if requirement.startswith("package:"):
            pkg = requirement.removeprefix("package:")
            return None if importlib.util.find_spec(pkg) else f"needs the package {pkg!r}"
        raise ValueError(f"unknown requirement {requirement!r}")


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
