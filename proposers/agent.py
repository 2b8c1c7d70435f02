"""The `agent` proposer: an external command drives the exploration, so any assistant can.

The command (options["cmd"], from `--agent-cmd`) is run once per ask with the exploration's
state on stdin, exactly `ExplorationState.to_json()` (champion, root, tried stacks with
their decisions, reasons and headlines, the technique catalogue with summaries and params
schemas, the device's capabilities, the champion's last profile), and the number of stacks
wanted in $ORCHESTRATE_PROPOSALS. It writes proposals on stdout as JSON:

    [{"techniques": ["static_kv_cache", {"name": "packed_projections",
                                          "params": {"fuse_output": true}}],
      "change": "+packed_projections", "reason": "why"}]

`[]` means it has nothing more to offer. A crash (non-zero exit), a timeout
(options["timeout"] seconds, 300 by default) or output that is not such a list raises
ProposerError: the loop records it in the exploration's ledger and goes on with the other
proposers. A proposal naming an unknown technique is not malformed: the loop records it as
a candidate that does not plan.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from typing import Any

from pydantic import ValidationError

from orchestrate.api.config import StackSpec, TechniqueRef
from orchestrate.api.proposer import ExplorationState, Proposal, Proposer, ProposerError

DEFAULT_TIMEOUT_S = 300.0


class Agent(Proposer):
    name = "agent"
    summary = "an external command: the state as JSON on stdin, proposals as JSON on stdout"

    def propose(self, state: ExplorationState, n: int) -> list[Proposal]:
        cmd = self.options.get("cmd")
        if not cmd:
            raise ProposerError("agent: no command to run (pass --agent-cmd)")
        argv = shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]
        timeout = float(self.options.get("timeout", DEFAULT_TIMEOUT_S))
        try:
            proc = subprocess.run(
                argv,
                input=json.dumps(state.to_json()),
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, "ORCHESTRATE_PROPOSALS": str(n)},
            )
        except subprocess.TimeoutExpired as exc:
            raise ProposerError(f"agent {cmd!r} timed out after {timeout:g} s") from exc
        except OSError as exc:
            raise ProposerError(f"agent {cmd!r} could not start: {exc}") from exc
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output on stderr"])[-1]
            raise ProposerError(f"agent {cmd!r} exited with status {proc.returncode}: {last}")
        return parse(proc.stdout, state.family)[:n]


def parse(text: str, family: str) -> list[Proposal]:
    """Proposals from an agent's stdout; ProposerError naming what is wrong with it."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProposerError(f"agent output is not JSON ({exc}): {text.strip()[:200]!r}") from exc
    if not isinstance(data, list):
        raise ProposerError(f"agent output must be a JSON list of proposals, not {_kind(data)}")
    return [_proposal(item, i, family) for i, item in enumerate(data)]


def _proposal(item: Any, i: int, family: str) -> Proposal:
    where = f"agent proposal {i}"
    if not isinstance(item, dict) or not isinstance(item.get("techniques"), list):
        raise ProposerError(f"{where}: needs a 'techniques' list, got {_kind(item)}")
    refs = []
    for t in item["techniques"]:
        if isinstance(t, str):
            refs.append(TechniqueRef(name=t))
        elif isinstance(t, dict) and isinstance(t.get("name"), str):
            params = t.get("params") or {}
            if not isinstance(params, dict):
                raise ProposerError(f"{where}: params of {t['name']!r} must be an object")
            refs.append(TechniqueRef(name=t["name"], params=params))
        else:
            raise ProposerError(f"{where}: a technique is a name or {{name, params}}, not {t!r}")
    try:
        stack = StackSpec(name=f"agent-{i}", family=family, techniques=refs)
    except ValidationError as exc:
        raise ProposerError(f"{where}: {exc.errors()[0]['msg']}") from exc
    change = item.get("change") or "agent: " + " > ".join(r.name for r in refs)
    return Proposal(stack=stack, change=str(change), reason=str(item.get("reason") or ""))


def _kind(value: Any) -> str:
    return type(value).__name__
