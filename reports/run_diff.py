"""What differs between two stored runs, and only that.

Comparing runs in MLflow shows every parameter and metric side by side; what people ask for
is the difference alone (mlflow#10477). Three parts, each leaving out what is equal:

- settings: the job (model, workload, protocol, code) and the environment (GPU, driver,
  clocks, package versions), flattened to dotted keys;
- stacks: for each stack name in both runs, its status and the techniques and parameters
  that changed; stacks in one run only are named;
- metrics: for each stack in both runs, every metric whose value moved by more than
  `threshold` (relative), with the ratio b / a.

Measured floats in the environment (clocks, power, the measured copy bandwidth) move a
little from run to run; they count as changed only beyond the same threshold.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrate.api.records import flatten

# Per-run bookkeeping (always different, never informative) and the stacks (diffed one by one).
IGNORED_JOB_KEYS = {"job_id", "output_dir", "stacks"}
ABSENT = "(absent)"


@dataclass
class Change:
    key: str
    a: Any
    b: Any


@dataclass
class MetricChange:
    stack: str
    metric: str
    a: float
    b: float

    @property
    def ratio(self) -> float | None:
        return self.b / self.a if self.a else None


@dataclass
class RunDiff:
    a: str
    b: str
    threshold: float
    settings: list[Change] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    stacks: dict[str, list[Change]] = field(default_factory=dict)
    metrics: list[MetricChange] = field(default_factory=list)
    unchanged_metrics: int = 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for m, row in zip(self.metrics, out["metrics"], strict=True):
            row["ratio"] = m.ratio
        return out


def differs(a: Any, b: Any, threshold: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return False
        scale = max(abs(a), abs(b))
        return scale > 0 and abs(a - b) / scale > threshold
    return json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str)


def changes(a: dict[str, Any], b: dict[str, Any], threshold: float) -> list[Change]:
    fa, fb = flatten(a), flatten(b)
    return [
        Change(k, fa.get(k, ABSENT), fb.get(k, ABSENT))
        for k in sorted(fa.keys() | fb.keys())
        if k not in fa or k not in fb or differs(fa[k], fb[k], threshold)
    ]


def settings_of(run: dict[str, Any]) -> dict[str, Any]:
    job = {k: v for k, v in run["job"].items() if k not in IGNORED_JOB_KEYS}
    return {"job": job, "environment": run.get("environment") or {}}


def stack_settings(stack: dict[str, Any]) -> dict[str, Any]:
    """A stack as its status, baseline flag and {technique: params}; order is kept apart
    because the same techniques in another order are another stack."""
    spec = stack["spec"]
    techniques = {t["name"]: t.get("params") or {} for t in spec.get("techniques", [])}
    return {
        "status": stack["status"],
        "baseline": spec.get("baseline", False),
        "order": [t["name"] for t in spec.get("techniques", [])],
        "techniques": techniques,
    }


def diff_runs(a: dict[str, Any], b: dict[str, Any], threshold: float = 0.02) -> RunDiff:
    """`a` and `b` are `Store.get_run` rows (utterances not needed)."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    out = RunDiff(a["id"], b["id"], threshold)
    out.settings = changes(settings_of(a), settings_of(b), threshold)
    stacks_a = {s["name"]: s for s in a["stacks"]}
    stacks_b = {s["name"]: s for s in b["stacks"]}
    out.only_in_a = [n for n in stacks_a if n not in stacks_b]
    out.only_in_b = [n for n in stacks_b if n not in stacks_a]
    for name in (n for n in stacks_a if n in stacks_b):
        sa, sb = stacks_a[name], stacks_b[name]
        spec_changes = changes(stack_settings(sa), stack_settings(sb), 0.0)
        if spec_changes:
            out.stacks[name] = spec_changes
        for metric in sorted(sa["metrics"].keys() & sb["metrics"].keys()):
            va, vb = sa["metrics"][metric], sb["metrics"][metric]
            if differs(float(va), float(vb), threshold):
                out.metrics.append(MetricChange(name, metric, va, vb))
            else:
                out.unchanged_metrics += 1
    return out
