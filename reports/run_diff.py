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

Runs measured under different protocols (another version or hash) are not compared:
`diff_runs` refuses them, or with `allow_protocol_mismatch` says so in `protocol_mismatch`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrate.api.protocol import ProtocolError, require_same
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
    protocol_mismatch: str | None = None  # set only when allowed: the numbers do not compare

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


def protocol_mismatch(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """Why runs `a` and `b` (run rows) were measured under different protocols, or None."""
    label = {
        f"{side}: run {r['id'][:8]} v{r.get('protocol_version')}": r.get("protocol_hash")
        for side, r in (("a", a), ("b", b))
    }
    try:
        require_same(label)  # the one check every comparison of results goes through
    except ProtocolError as exc:
        return str(exc)
    return None


def diff_runs(
    a: dict[str, Any],
    b: dict[str, Any],
    threshold: float = 0.02,
    allow_protocol_mismatch: bool = False,
) -> RunDiff:
    """`a` and `b` are `Store.get_run` rows (utterances not needed). Runs under different
    protocols raise ProtocolError unless `allow_protocol_mismatch`, which marks the diff."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    mismatch = protocol_mismatch(a, b)
    if mismatch and not allow_protocol_mismatch:
        raise ProtocolError(f"{mismatch}; --allow-protocol-mismatch shows the diff, marked")
    out = RunDiff(a["id"], b["id"], threshold, protocol_mismatch=mismatch)
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
