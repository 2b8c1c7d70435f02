"""The exploration loop, top to bottom (`Explorer.run`):

    finish the round a killed session left open (the journal says which job was in flight)
    until the budget is spent, K proposals in a row gained nothing, no proposer has more, or
    the champion reached the --target:
        profile a new champion first, when a proposer reads profiles (`profile`): one job of
        the champion alone, its slots timed and its GPU-idle time per step measured
        fill a round: ask the proposers in turn for up to --per-job stacks; a proposer that
        fails is ledgered; each candidate is written `open`, deduped on its identity (stack
        + code + protocol + hardware: a repeat is never run) and planned alone (a stack that
        does not plan is refused before anything runs)
        dev: one job of the champion and every candidate of the round (interleaved: each
            judged against the champion, paired); stock only while it is the champion, or
            when a proposer reads every candidate's headline (jobs: stock's token loop is
            most of a job once the champion is fast)
        fresh: one job on fresh seeds of the dev winners, and of the winners combined (the
            loop's own candidate, `combine`: changes that each pay alone may add up)
        gate: the fresh winners, best first, until one is accepted (run_gate: the holdout,
            audited; the fresh job is its remeasure when it measured the same stacks, code,
            protocol and hardware); the rest are `superseded`: proposed again from the new
            champion
        after each job: a decision per candidate with its numbers and reason
        (explore.decisions), journaled; each decided candidate is ledgered when rejected and
        told to its proposer (observe)
        an accept moves the champion: proposers start over from it

Jobs go through a Submitter (explore.submit) onto the executor: a live pool of workers
(`orchestrate workers`) or one worker here. On a pool of N workers a round's dev candidates
go as N jobs at once (each with the champion: judged paired within its job), and so do its
fresh remeasures.
The store is written before MLflow, which is best effort.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrate.api.config import ConfigError, ModelSpec, StackSpec, Workload, explain
from orchestrate.api.proposer import Decision, Proposal, Proposer, ProposerError, refused_here
from orchestrate.api.protocol import Protocol, ProtocolError, phase_workload
from orchestrate.api.records import JobSpec, utcnow
from orchestrate.api.registry import StackError
from orchestrate.api.scoring import ScoringError
from orchestrate.api.sealed import HoldoutLeak
from orchestrate.explore import guards, jobs, state, tracking
from orchestrate.explore.budget import Budget
from orchestrate.explore.decisions import (
    NEXT_PHASE,
    Step,
    headline_numbers,
    judge_gate,
    judge_measured,
)
from orchestrate.explore.submit import Submission, Submitter
from orchestrate.research import decide
from orchestrate.research.holdout import HoldoutError
from orchestrate.running import metrics
from orchestrate.running.runner import Outcome, ResumeRefused, comparisons, plan_resume
from orchestrate.store.errors import StoreError

PROPOSALS_PER_ASK = 4  # how many stacks a proposer is asked for at a time (queued)
PROPOSER_FAILURES = 2  # a proposer failing this often in a row is not asked again
RETRY_DRAW = 10_000  # a noisy fresh job's retry draws seeds beyond any candidate number
COMBINE = "combine"  # the proposer name of the loop's own candidates: a round's winners together


@dataclass
class Setup:
    """What an exploration runs with; fixed for its life (its row keeps it for --resume)."""

    store: Any
    model: ModelSpec
    dev: Workload
    protocol: Protocol
    stock: StackSpec
    proposers: list[Proposer]
    budget: Budget
    patience: int
    submitter: Submitter
    runs_dir: Path
    track: bool
    holdout_file: Path | None = None
    fidelity_steps: int = 32
    target: float | None = None  # stop once the champion's headline reaches it
    per_job: int = 4  # candidates measured together in one dev job (a round)
    say: Callable[[str], None] = lambda line: None
    on_event: Callable[[dict[str, Any]], None] = lambda e: None
    warnings: list[str] = field(default_factory=list)


class Explorer:
    def __init__(self, setup: Setup, exploration_id: str) -> None:
        self.s, self.id = setup, exploration_id
        row = setup.store.get_exploration(exploration_id)
        self.champion = StackSpec.model_validate(row["champion"])
        self.elapsed0, self.jobs = row["elapsed_s"], row["jobs"]
        self.t0 = time.monotonic()
        self.stack_seconds: list[float] = []  # per job: its seconds over its stacks
        self.clip_s: dict[str, float] = {}  # stack name -> seconds per clip, last measured
        self.extra_s: list[float] = []  # per job: seconds per stack beyond its clips
        # a resume that extended a finished exploration counts patience from there
        after = row["options"].get("patience_from", 0)
        self.since_gain = _since_gain([c for c in row["candidates"] if c["seq"] > after])
        self.profile: dict[str, float] = {}  # the champion's (state.profile_of)
        self.profiled: str | None = None  # the champion whose profile was measured
        self.hardware = row["hardware"]
        self.random_weights = decide.random_weights(setup.model)
        self.techniques = state.technique_catalogue(setup.model.family)
        self.stock_in_dev = any(p.reads_headlines for p in setup.proposers)
        self.caps = state.device_caps(setup.model.device, self.techniques)
        self.failures: dict[str, int] = {}
        self.turn = 0
        self.mlflow_id = None
        if setup.track:
            self.mlflow_id, warning = tracking.start(row)
            self._warn(warning)
            if self.mlflow_id and not row["mlflow_run_id"]:
                setup.store.update_exploration(exploration_id, mlflow_run_id=self.mlflow_id)

    # ----------------------------------------------------------------------- the loop

    def run(self) -> str:
        """Explore until a stop rule holds; returns why it stopped (also stored)."""
        self._reopen_cut()
        self._after_round(self._finish_open())  # a killed session's round, where it stopped
        queues: dict[str, deque[Proposal]] = {p.name: deque() for p in self.s.proposers}
        exhausted: set[str] = set()
        while True:
            if why := self._spent(1, [None] * self.s.per_job, "dev") or self._target_reached():
                return self._stop(why)
            if self.since_gain >= self.s.patience:
                return self._stop(
                    f"patience: {self.since_gain} proposals in a row without a gain above the "
                    f"noise bar (min speedup {self.s.protocol.speed.min_speedup:g})"
                )
            if self._profile_champion():
                continue  # it ran a job: the budget is checked again before the round
            opened = self._fill_round(queues, exhausted)
            if not opened:
                names = ", ".join(p.name for p in self.s.proposers)
                return self._stop(f"every proposer is exhausted ({names}): nothing new to try")
            live = [c for _, _, c in opened if c["status"] == "open"]
            decided = {c["id"]: c for c in self._round(live)}
            for proposer, proposal, cand in opened:
                cand = decided.get(cand["id"], cand)
                if cand["spec"] is not None:
                    proposer.observe(proposal, state.tried_of([cand])[0])
            if self._after_round([c for _, _, c in opened] + list(decided.values())):
                for q in queues.values():  # proposals made against the old champion
                    q.clear()
                exhausted.clear()

    def _after_round(self, cands: list[dict[str, Any]]) -> bool:
        """Patience after a round (each candidate decided once counts once); True when the
        champion moved."""
        seen: dict[int, dict[str, Any]] = {c["id"]: c for c in cands}
        moved = False
        for cand in sorted(seen.values(), key=lambda c: c["seq"]):
            if cand["decision"] == "accept":
                self.since_gain, moved = 0, True
            elif not _spends_no_patience(cand):
                self.since_gain += 1
        return moved

    def _fill_round(
        self, queues: dict[str, deque[Proposal]], exhausted: set[str]
    ) -> list[tuple[Proposer, Proposal, dict[str, Any]]]:
        """Up to `per_job` proposals, each written as a candidate at once (so the next
        proposer sees it pending and does not propose it again); those refused before any
        job (a duplicate, a stack that does not plan) are decided already."""
        opened = []
        while len(opened) < self.s.per_job:
            picked = self._next_proposal(queues, exhausted)
            if picked is None:
                break
            proposer, proposal = picked
            opened.append((proposer, proposal, self._open_candidate(proposer.name, proposal)))
        return opened

    def _next_proposal(
        self, queues: dict[str, deque[Proposal]], exhausted: set[str]
    ) -> tuple[Proposer, Proposal] | None:
        """The next proposal, asking the proposers in turn; None when none has any."""
        proposers = self.s.proposers
        for i in range(len(proposers)):
            proposer = proposers[(self.turn + i) % len(proposers)]
            queue = queues[proposer.name]
            if not queue and proposer.name not in exhausted:
                queue.extend(self._ask(proposer, exhausted))
            if queue:
                self.turn = (self.turn + i + 1) % len(proposers)
                return proposer, queue.popleft()
        return None

    def _ask(self, proposer: Proposer, exhausted: set[str]) -> list[Proposal]:
        try:
            proposals = proposer.propose(self._state(), PROPOSALS_PER_ASK)
            if not isinstance(proposals, list) or not all(
                isinstance(p, Proposal) for p in proposals
            ):
                raise ProposerError(f"propose() returned {type(proposals).__name__}, not Proposals")
        except Exception as exc:  # a crashing plugin is ledgered; the others go on
            self._proposer_failed(proposer.name, exc)
            if self.failures[proposer.name] >= PROPOSER_FAILURES:
                exhausted.add(proposer.name)
            return []
        self.failures[proposer.name] = 0
        if not proposals:
            exhausted.add(proposer.name)  # until the champion moves
        return proposals

    def _state(self) -> Any:
        row = self.s.store.get_exploration(self.id)
        return state.build_state(row, row["candidates"], self.caps, self.techniques, self.profile)

    # ------------------------------------------------------------------ one round

    def _open_candidate(self, proposer: str, proposal: Proposal) -> dict[str, Any]:
        """Write the candidate; dedup it and plan it alone before anything is submitted.
        Returns it `open` with its identity, or decided (a duplicate or a refusal)."""
        spec = jobs.canonical(proposal.stack, self.s.stock)
        cand = self.s.store.add_candidate(
            self.id,
            proposer=proposer,
            change=proposal.change,
            proposal_reason=proposal.reason,
            parent_name=self.champion.name,
            parent_hash=self.champion.content_hash(),
            stack_name=spec.name,
            stack_hash=spec.content_hash(),
            spec=spec.model_dump(mode="json"),
        )
        self.s.say(f"#{cand['seq']} {proposer} {proposal.change}: {spec.name}")
        for other, what, why in (
            (self.champion, "the champion", "measured in every job"),
            (self.s.stock, "stock", "the baseline of every headline"),
        ):
            if jobs.same(spec, other):
                said = f"is {what} ({other.name}), {why}: not submitted"
                return self._decide(cand, Step("dedup", "duplicate", said))
        return self._identify(cand, spec)

    def _identify(self, cand: dict[str, Any], spec: StackSpec) -> dict[str, Any]:
        """Plan `spec` alone in a dev job: refused if it does not plan; its identity (the
        stack in the dev setting, whatever phase it starts in) dedups it."""
        try:
            job = self._plan([spec], "dev", cand["seq"])
        except (StackError, ConfigError, ValueError) as exc:  # before anything is submitted
            return self._decide(cand, Step("plan", "error", f"does not plan: {exc}", "refused"))
        identity = jobs.candidate_identity(job, spec, self.hardware)
        earlier = self._same_identity(identity, cand["id"])
        if earlier is not None:
            state_ = earlier["decision"] or "in this round"
            why = (
                f"same stack, code, protocol and hardware as #{earlier['seq']} "
                f"({state_}): not submitted"
            )
            return self._decide(cand, Step("dedup", "duplicate", why))
        self.s.store.update_candidate(cand["id"], identity=identity)
        return cand | {"identity": identity}

    def _round(self, cands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Take open candidates through dev -> fresh -> gate together: one job per phase for
        all that are there (each starts where its journal says). Returns them decided."""
        done: list[dict[str, Any]] = []
        live = list(cands)
        winners: list[dict[str, Any]] = []
        # The second fresh job remeasures the first's noisy ones (decisions: retry_noise).
        for phase, again in (("dev", False), ("fresh", False), ("fresh", True)):
            group = [c for c in live if _next_phase(c) == phase]
            if phase == "fresh" and not again:
                group = self._fresh_group(group, winners, done)
                ids = {c["id"] for c in live}
                live += [c for c in group if c["id"] not in ids]  # the combination, if any
            if not group:
                continue
            names = [c["stack_name"] for c in group]
            if phase == "fresh" and (why := self._spent(1, names, phase)):
                done += [self._not_run(c, phase, why) for c in group]
                live = [c for c in live if c not in group]
                continue
            for cand, step in zip(group, self._measure(group, phase), strict=True):
                cand = self._record_step(cand, step)
                live = [cand if c["id"] == cand["id"] else c for c in live]
                if step.decision not in NEXT_PHASE:
                    done.append(self._decide(cand, step, recorded=True))
                elif phase == "dev":
                    winners.append(cand)
            live = [c for c in live if c["id"] not in {d["id"] for d in done}]
        return done + self._gate_round([c for c in live if _next_phase(c) == "gate"])

    def _fresh_group(
        self,
        group: list[dict[str, Any]],
        winners: list[dict[str, Any]],
        done: list[dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The round's fresh job: every dev winner (best first) and, when two or more won,
        the winners combined (if that combination is new): at most `per_job` + 1 stacks.
        None is left out: a winner's identity is taken once it is measured, so a winner
        not remeasured now would never be."""
        best = sorted(group, key=_vs_parent, reverse=True)
        union = self._combine(winners) if len(winners) >= 2 else None
        if union is not None and union["status"] != "open":
            done.append(union)  # a duplicate of something measured: decided, not run
            union = None
        return ([union] if union is not None else []) + best

    def _combine(self, winners: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The champion with every dev winner's change, where they fit together (a slot
        two of them fill goes to the faster): the loop's own candidate, straight to fresh."""
        picked = sorted(winners, key=_vs_parent, reverse=True)
        stack = jobs.combine(self.champion, [StackSpec.model_validate(c["spec"]) for c in picked])
        specs = [StackSpec.model_validate(c["spec"]) for c in picked]
        if stack is None or any(jobs.same(stack, s) for s in [self.champion, *specs]):
            return None  # nothing fits, or the union is one of the winners already
        used = [c for c, s in zip(picked, specs, strict=True) if jobs.covers(stack, s)]
        if len(used) < 2:
            return None  # one winner fits: it is measured on its own already
        change = " ".join(c["change"] for c in used)
        why = (
            f"dev winners {', '.join('#' + str(c['seq']) for c in used)} together: each "
            "cleared the bar alone; the fresh job says whether they add up"
        )
        return self._open_candidate(COMBINE, Proposal(stack=stack, change=change, reason=why))

    def _gate_round(self, cands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The fresh winners through the gate, best first, until one is accepted; the rest
        were measured against a champion that is no longer it and wait for the next round."""
        done: list[dict[str, Any]] = []
        accepted = None
        for cand in sorted(cands, key=_vs_parent, reverse=True):
            if accepted is not None:
                why = (
                    f"not gated: #{accepted['seq']} of its round was accepted first; its "
                    "change is proposed again from the new champion"
                )
                done.append(self._not_run(cand, "gate", why, "superseded"))
                continue
            # The gate: the holdout, and a remeasure unless the fresh run stands in for it.
            needs = 1 if _fresh_run_id(cand) else 2
            if why := self._spent(needs, [cand["stack_name"]], "gate"):
                done.append(self._not_run(cand, "gate", why))
                continue
            step = self._gate(cand)
            cand = self._decide(self._record_step(cand, step), step, recorded=True)
            done.append(cand)
            if cand["decision"] == "accept":
                accepted = cand
                self._crown(cand)
        return done

    def _not_run(
        self, cand: dict[str, Any], phase: str, why: str, decision: Decision | None = None
    ) -> dict[str, Any]:
        """A candidate sent to `phase` that does not run there: it keeps its last decision
        (or `decision`), and the reason says why it went no further."""
        last = cand["steps"][-1] if cand["steps"] else None  # a combination starts at fresh
        step = Step(
            "budget" if why.startswith("budget") else "round",
            decision or (last["decision"] if last else "drop"),
            f"sent to {phase}, not run: {why}",
            None,
            last["quality_path"] if last else None,
        )
        return self._decide(cand, step)

    def _measure(self, group: list[dict[str, Any]], phase: str) -> list[Step]:
        """A dev or fresh group on an executor of several slots is split into that many
        jobs, run at once (each with the champion, and stock as planned, so every candidate
        is still judged paired within its own job; each fresh job on seeds of its own);
        otherwise one job (`_measure_one`). The gate stays one candidate at a time, best
        first: the holdout opens only for the one that may be accepted."""
        slots = max(1, int(getattr(self.s.submitter, "slots", 1)))
        if phase not in ("dev", jobs.FRESH) or slots == 1 or len(group) == 1:
            return self._measure_one(group, phase)
        parts = [group[i::slots] for i in range(min(slots, len(group)))]
        steps: dict[int, Step] = {}
        planned: list[tuple[list[dict[str, Any]], list[StackSpec], JobSpec]] = []
        for part in parts:
            specs = [StackSpec.model_validate(c["spec"]) for c in part]
            recovered = self._recover(part, phase)
            if recovered is not None:
                for c, spec in zip(part, specs, strict=True):
                    steps[c["id"]] = self._judge(c, spec, phase, recovered)
                continue
            try:
                job = self._plan(specs, phase, _draw(part))
            except (StackError, ConfigError, ValueError) as exc:
                for c in part:
                    steps[c["id"]] = Step(phase, "error", f"does not plan: {exc}", "refused")
                continue
            for cand in part:
                self._journal(cand, phase, job.job_id)
            planned.append((part, specs, job))
        force = phase == jobs.FRESH  # fresh seeds are never served from an earlier run
        outcomes = self._submit_all([Submission(job, force=force) for _, _, job in planned])
        for (part, specs, _), outcome in zip(planned, outcomes, strict=True):
            if outcome.result is None and len(part) > 1:
                part_steps = self._alone(part, specs, phase, outcome)
            else:
                part_steps = [
                    self._judge(c, s, phase, outcome) for c, s in zip(part, specs, strict=True)
                ]
            steps.update({c["id"]: st for c, st in zip(part, part_steps, strict=True)})
        return [steps[c["id"]] for c in group]

    def _measure_one(self, group: list[dict[str, Any]], phase: str) -> list[Step]:
        """One job of `group` (dev or fresh) and a decision for each. A job the journal says
        was in flight when a session died is recovered, not measured again."""
        specs = [StackSpec.model_validate(c["spec"]) for c in group]
        outcome = self._recover(group, phase)
        if outcome is None:
            try:
                job = self._plan(specs, phase, _draw(group))
            except (StackError, ConfigError, ValueError) as exc:
                return [Step(phase, "error", f"does not plan: {exc}", "refused")] * len(group)
            for cand in group:
                self._journal(cand, phase, job.job_id)
            outcome = self._submit(Submission(job, force=phase == jobs.FRESH))
            if outcome.result is None and len(group) > 1:
                return self._alone(group, specs, phase, outcome)
        return [self._judge(c, s, phase, outcome) for c, s in zip(group, specs, strict=True)]

    def _alone(
        self, group: list[dict[str, Any]], specs: list[StackSpec], phase: str, failed: Outcome
    ) -> list[Step]:
        """A job that failed as a whole (its worker died: a crash, a device-side assert,
        the OOM killer) says nothing about which of its candidates did it, and one stack
        that poisons the device fails every stack beside it (on the H200, a device-side
        assert in one warm-up failed all four candidates of a job). So each is measured in
        a job of its own, within the budget; one the budget leaves out keeps the error."""
        seqs = ", ".join(f"#{c['seq']}" for c in group)
        self.s.say(f"{seqs} {phase}: the job failed as a whole ({failed.error}); each alone")
        steps = []
        for cand, spec in zip(group, specs, strict=True):
            why = self._spent(1, [cand["stack_name"]], phase)
            if why is None:
                try:
                    job = self._plan([spec], phase, _draw([cand]))
                except (StackError, ConfigError, ValueError) as exc:
                    why = f"does not plan alone: {exc}"
            if why is not None:
                error = f"{failed.error or 'the job failed'}; not measured alone: {why}"
                steps.append(Step(phase, "error", error, run_id=failed.run_id))
                continue
            self._journal(cand, phase, job.job_id)
            outcome = self._submit(Submission(job, force=phase == jobs.FRESH))
            steps.append(self._judge(cand, spec, phase, outcome))
        return steps

    def _judge(self, cand: dict[str, Any], spec: StackSpec, phase: str, out: Outcome) -> Step:
        if out.result is None:
            return Step(phase, "error", out.error or f"run {out.status}", run_id=out.run_id)
        by = {r.stack.name: r for r in out.result.results}
        stock = by.get(self.s.stock.name)  # None: a dev job without it (jobs)
        parent, mine = by.get(self.champion.name, stock), by[spec.name]
        assert parent is not None, "every job holds the champion"
        # The guards' and fidelity thresholds' reference: stock, or else the champion, which
        # passed them against stock before it was crowned (the remeasure, with stock, judges
        # again: a dev pass against the champion never reaches the gate on its own).
        reference = stock or parent
        comparison = out.comparisons.get(spec.name, {})
        invalid = guards.invalid_reasons(
            mine, reference, comparison, Path(out.result.job.output_dir)
        )
        step = judge_measured(
            phase,
            mine,
            parent,
            reference,
            self.s.protocol,
            invalid=invalid,
            noisy=metrics.result_noise(out.result, out.comparisons),
            random_weights=self.random_weights,
            change=cand["change"],
            retry_noise=phase == jobs.FRESH and _fresh_run_id(cand) is None,
        )
        # The run's comparisons are against its first stack: the headline only when that
        # is stock (in a dev job without stock they are against the champion).
        headline = headline_numbers(comparison) if stock is out.result.results[0] else {}
        return replace(step, run_id=out.run_id, numbers=step.numbers | headline)

    def _gate(self, cand: dict[str, Any]) -> Step:
        """The phase gate (research.gate.run_gate): the only place the holdout opens."""
        from orchestrate.research.gate import run_gate

        if cand["phase"] == "gate":  # a session died in this gate: what became of it
            return self._regate(cand)
        self._journal(cand, "gate", None)
        spec = StackSpec.model_validate(cand["spec"])
        started, report = time.monotonic(), None
        try:
            report = run_gate(
                self.s.store,
                candidate=spec,
                model=self.s.model,
                dev=self.s.dev,
                protocol=self.s.protocol,
                runs_dir=self.s.runs_dir,
                track=self.s.track,
                holdout_file=self.s.holdout_file,
                on_event=self.s.on_event,
                submit=self._gate_job,
                remeasured=self._fresh_run(cand),
            )
            step = judge_gate(report)
        except (ProtocolError, HoldoutError, StackError, ScoringError, HoldoutLeak) as exc:
            step = Step("gate", "error", f"the gate failed: {exc}")
        # Jobs it ran: its own remeasure (unless the fresh run stood in), its holdout.
        ran = int(bool(report and report.get("remeasure_from") == "this gate"))
        ran += int(bool(report and report.get("holdout_run")))
        self._count_jobs(ran, time.monotonic() - started, self._stacks(1, "gate"))
        return step

    def _gate_job(self, job: JobSpec) -> Outcome:
        """One of the gate's jobs, through the Submitter (counted by `_gate`)."""
        started = time.monotonic()
        (outcome,) = self.s.submitter.submit([Submission(job, force=True)])
        self._learn(outcome, time.monotonic() - started)
        return outcome

    def _fresh_run(self, cand: dict[str, Any]) -> Outcome | None:
        """The candidate's fresh-seed run, from the store (also after a resume): the gate's
        remeasure, if the gate finds it measured what its own would (run_gate checks)."""
        run_id = _fresh_run_id(cand)
        return None if run_id is None else self._stored(run_id)

    def _stored(self, run_id: str) -> Outcome | None:
        """A recorded run as an Outcome; None when it has no result (its worker died)."""
        try:
            result = self.s.store.get_result(run_id)
        except StoreError:  # not found, or recorded without a result
            return None
        return Outcome(run_id, result.status, result, comparisons(result), None)

    def _regate(self, cand: dict[str, Any]) -> Step:
        """A gate a killed session was in: gate again only if the holdout was not opened
        for it (re-opening it would flag the stack as re-submitted, by design)."""
        spec_hash = StackSpec.model_validate(cand["spec"]).content_hash()
        since = cand["phase_started_at"]
        audits = [
            a
            for a in self.s.store.list_holdout_audits(self.s.dev.name)
            if a["stack_hash"] == spec_hash and since is not None and a["opened_at"] >= since
        ]
        if not audits:
            return self._gate(cand | {"phase": None})
        audit = audits[-1]
        if audit["status"] in ("accept", "retain"):
            stored = decide.run_headline(self.s.store, audit["run_id"], spec_hash)
            why = f"the gate decided {audit['status']} before the session died"
            why += f" (holdout audit #{audit['id']})"
            numbers = headline_numbers(stored)
            return Step("gate", audit["status"], why, None, None, numbers, audit["run_id"])
        return Step(
            "gate",
            "error",
            f"the session died in its gate after the holdout was opened (audit #{audit['id']}, "
            f"{audit['status']}); opening it again would flag the stack, so it is not re-gated",
        )

    # -------------------------------------------------------------------- submitting

    def _plan(self, specs: list[StackSpec], phase: str, draw: int) -> JobSpec:
        """A job of the champion (the candidates' parent: the champion moves only between
        rounds), `specs`, and stock unless it is a dev job without it (jobs.job_stacks). A
        fresh job's seeds are drawn from `draw` (the lowest candidate number in it: every
        fresh job gets seeds no other job had)."""
        workload = (
            jobs.dev_workload(self.s.dev)
            if phase == "dev"
            else jobs.fresh_workload(self.s.dev, self.s.protocol, draw)
        )
        with_stock = phase != "dev" or self.stock_in_dev
        stacks = jobs.job_stacks(self.s.stock, self.champion, specs, with_stock)
        job = jobs.plan(
            self.s.model,
            workload,
            stacks,
            self.s.protocol,
            self.s.runs_dir,
            self.s.fidelity_steps,
        )
        # No kernel counts in dev and fresh jobs: no decision reads them, and under the
        # profiler a host-bound loop (stock, and every candidate without a captured loop)
        # took 20-27 s a stack on the H200, more than timing it. The gate's jobs count all.
        return job.model_copy(update={"count_launches": []})

    def _profile_champion(self) -> bool:
        """Profile the champion before proposing for it, when a proposer reads profiles:
        one job of the champion alone on the first dev prompt and seed, its slots timed and
        its kernels counted (the GPU-busy time per step says how much of a step is host
        work). Once per champion; a job recorded before (a resumed exploration) is served
        back, not run again; a failed profile leaves it empty (the proposer then waits).
        True when it submitted a job."""
        if self.profiled == self.champion.content_hash() or not any(
            p.name == "profile" for p in self.s.proposers
        ):
            return False
        self.profiled = self.champion.content_hash()
        dev = self.s.dev
        workload = Workload.model_validate(
            dev.model_dump()
            | {
                "name": phase_workload(dev.name, "profile"),
                "prompts": dev.prompts[:1],
                "seeds": dev.seeds[:1],
                "save_audio": 0,
            }
        )
        try:
            job = jobs.plan(
                self.s.model, workload, [self.champion], self.s.protocol, self.s.runs_dir, 0
            )
        except (StackError, ConfigError, ValueError) as exc:
            self.s.say(f"profile of {self.champion.name} not planned: {exc}")
            return False
        job = job.model_copy(update={"profile_slots": True, "count_launches": [self.champion.name]})
        self.s.say(f"profiling the champion {self.champion.name}")
        outcome = self._submit(Submission(job), estimates=False)
        if outcome.result is None:
            self.s.say(f"profile of {self.champion.name} failed: {outcome.error}")
            return True
        self.profile = state.profile_of(outcome.result.results[0])
        self.s.say(f"profile of {self.champion.name}: {state.describe_profile(self.profile)}")
        return True

    def _submit(self, submission: Submission, estimates: bool = True) -> Outcome:
        """Run one job and count it. `estimates`: its time per stack goes into the budget's
        estimate (not the profile job's: one stack on one clip, and the first job pays the
        worker's start, which later jobs do not)."""
        started = time.monotonic()
        (outcome,) = self.s.submitter.submit([submission])
        seconds = time.monotonic() - started
        self._learn(outcome, seconds, estimates)
        self._count_jobs(1, seconds if estimates else None, len(submission.job.stacks))
        return outcome

    def _submit_all(self, subs: list[Submission]) -> list[Outcome]:
        """Jobs run at once on the executor's slots and counted: each job's seconds are the
        batch's wall time (they ran side by side), which is what the budget spends."""
        if not subs:
            return []
        started = time.monotonic()
        outcomes = self.s.submitter.submit(subs)
        seconds = time.monotonic() - started
        for sub, outcome in zip(subs, outcomes, strict=True):
            self._learn(outcome, seconds)
            self._count_jobs(1, seconds, len(sub.job.stacks))
        return outcomes

    def _stacks(self, candidates: int, phase: str) -> int:
        """Stacks in a `phase` job of `candidates`: the champion and stock come with them."""
        return len(self._job_names([None] * candidates, phase))

    def _job_names(self, names: list[str | None], phase: str) -> list[str | None]:
        """The stack names of a `phase` job of candidates `names`, as `_plan` plans it."""
        stock, champ = self.s.stock, self.champion
        with_stock = phase != "dev" or self.stock_in_dev
        return [s.name for s in jobs.job_stacks(stock, champ, [], with_stock)] + names

    def _count_jobs(self, n: int, seconds: float | None, stacks: int) -> None:
        """`n` more jobs; their `seconds` (None: not an estimate's sample) per stack."""
        self.jobs += n
        if seconds is not None:
            self.stack_seconds += [seconds / max(n, 1) / max(stacks, 1)] * n
        self.s.store.update_exploration(self.id, jobs=self.jobs, elapsed_s=self._elapsed())

    def _recover(self, group: list[dict[str, Any]], phase: str) -> Outcome | None:
        """What became of the job `group` was in when a session died (all of it journaled
        in that one job): its recorded result, the interrupted run resumed
        (runner.plan_resume: what it measured is kept), or None (measure it afresh)."""
        job_ids = {c["job_id"] for c in group if c["phase"] == phase}
        if len(job_ids) != 1 or None in job_ids or any(c["phase"] != phase for c in group):
            return None
        (job_id,) = job_ids
        run = self.s.store.run_of_job(job_id)
        if run is None:
            return None
        seqs = ", ".join(f"#{c['seq']}" for c in group)
        if run["status"] == "INTERRUPTED":
            try:
                job, folder = plan_resume(self.s.store, run["id"])
            except ResumeRefused as exc:
                self.s.say(f"{seqs}: measuring again ({exc})")
                return None
            for cand in group:
                self._journal(cand, phase, job.job_id)
            self.s.say(f"{seqs}: resuming run {run['id'][:12]}")
            return self._submit(Submission(job, force=True, recordings_from=folder))
        if run["status"] == "RUNNING":
            return None  # reconciled runs are never RUNNING; one of another host: redo
        outcome = self._stored(run["id"])
        if outcome is None:  # a worker that died outright: the run says why
            error = self.s.store.get_run(run["id"], utterances=False).get("error")
            return Outcome(run["id"], "FAILED", None, {}, None, error=error)
        return outcome

    # --------------------------------------------------------------------- the journal

    def _journal(self, cand: dict[str, Any], phase: str, job_id: str | None) -> None:
        """Before a job starts: which phase and job the candidate is in (for --resume)."""
        fields: dict[str, Any] = {"phase": phase, "job_id": job_id}
        if cand.get("phase") != phase:
            fields["phase_started_at"] = utcnow()
        self.s.store.update_candidate(cand["id"], **fields)
        cand.update(fields)

    def _record_step(self, cand: dict[str, Any], step: Step) -> dict[str, Any]:
        steps = [*cand["steps"], step.to_dict()]
        runs = [*cand["run_ids"], *step.other_runs, *([step.run_id] if step.run_id else [])]
        # Its job is decided on: no longer in flight (a noisy fresh job's retry is a new one)
        fields = {"steps": steps, "run_ids": runs, "job_id": None}
        self.s.store.update_candidate(cand["id"], **fields)
        if step.phase in ("dev", "fresh", "gate"):
            self.s.say(f"#{cand['seq']} {step.phase}: {step.decision}: {step.reason}")
        return cand | fields

    def _decide(self, cand: dict[str, Any], step: Step, recorded: bool = False) -> dict[str, Any]:
        """The candidate's final decision: its row `decided`, a rejection in the failures
        ledger (the gate ledgers its own), its runs nested under the exploration in MLflow."""
        if not recorded:
            cand = self._record_step(cand, step)
        numbers = _best_numbers(cand["steps"])
        fields = {
            "status": "decided",
            "decision": step.decision,
            "reason": step.reason,
            "quality_path": step.quality_path or _last(cand["steps"], "quality_path"),
            "phase": None,
            "job_id": None,
            **{k: numbers.get(k) for k in _NUMBER_COLUMNS},
        }
        self.s.store.update_candidate(cand["id"], **fields)
        cand = cand | fields
        if step.cause:
            who = f"exploration {self.id[:8]} #{cand['seq']} ({cand['proposer']} {cand['change']})"
            self.s.store.record_failure(
                cand["stack_name"], step.cause, f"{who}: {step.reason}", step.run_id
            )
        if step.phase in ("plan", "dedup"):
            self.s.say(f"#{cand['seq']} {step.decision}: {step.reason}")
        if self.s.track and self.mlflow_id:
            self._nest(cand)
        self.s.store.update_exploration(self.id, elapsed_s=self._elapsed())
        return cand

    def _nest(self, cand: dict[str, Any]) -> None:
        runs = []
        for run_id in cand["run_ids"]:
            try:
                runs.append(self.s.store.get_run(run_id, utterances=False)["mlflow_run_id"])
            except LookupError:
                continue
        tags = {
            "exploration_id": self.id,
            "candidate": str(cand["seq"]),
            "candidate_stack": cand["stack_name"] or "",
            "candidate_decision": cand["decision"],
        }
        self._warn(tracking.nest(self.mlflow_id, runs, tags))

    def _proposer_failed(self, name: str, exc: BaseException) -> None:
        """A crash, timeout or malformed output: ledgered, and the exploration goes on."""
        self.failures[name] = self.failures.get(name, 0) + 1
        if isinstance(exc, ValidationError):  # a malformed stack: its fields, in words
            why = f"invalid {exc.title}: {explain(exc)}"
        else:
            why = str(exc) if isinstance(exc, ProposerError) else f"{type(exc).__name__}: {exc}"
        cand = self.s.store.add_candidate(
            self.id,
            proposer=name,
            change="(proposer failed)",
            proposal_reason="",
            parent_name=self.champion.name,
            parent_hash=self.champion.content_hash(),
        )
        self.since_gain += 1  # a failing proposer spends patience: it cannot loop forever
        self._decide(cand, Step("proposer", "error", f"proposer {name} failed: {why}", "other"))
        self.s.say(f"#{cand['seq']} proposer {name} failed: {why}")

    def _crown(self, cand: dict[str, Any]) -> None:
        self.champion = StackSpec.model_validate(cand["spec"])
        self.profile = {}  # the old champion's; the new one is profiled before proposals
        self.s.store.update_exploration(
            self.id,
            champion=cand["spec"],
            champion_headline=cand["headline"],
            champion_lo=cand["headline_lo"],
            champion_hi=cand["headline_hi"],
        )
        self.s.say(f"champion: {self.champion.name} ({_headline_text(cand)} vs stock)")

    # --------------------------------------------------------------------- resuming

    def _reopen_cut(self) -> None:
        """Candidates an earlier session's budget stopped on their way to fresh or the gate
        go on (a resume with a new --budget), if the champion is still their parent: their
        numbers were measured against it. Their `budget` step stays in their history."""
        parent = self.champion.content_hash()
        for cand in self.s.store.list_candidates(self.id):
            last = cand["steps"][-1] if cand["steps"] else None
            cut = last is not None and last["phase"] == "budget" and cand["status"] == "decided"
            if cut and cand["decision"] in NEXT_PHASE and cand["parent_hash"] == parent:
                self.s.store.update_candidate(cand["id"], status="open", decided_at=None)
                where = NEXT_PHASE[cand["decision"]]
                self.s.say(f"#{cand['seq']}: the budget stopped it; going on to {where}")

    def _finish_open(self) -> list[dict[str, Any]]:
        """Carry the open candidates of a killed session on from where their journals stop,
        as one round; returns them decided."""
        live = []
        for cand in self.s.store.list_candidates(self.id):
            if cand["status"] != "open":
                continue
            self.s.say(f"#{cand['seq']}: resuming at {cand['phase'] or 'its start'}")
            if cand["spec"] is None:  # a proposer failure is written decided at once
                self._decide(cand, Step("proposer", "error", "interrupted before it was recorded"))
            elif not cand["identity"]:  # killed before it was planned
                spec = StackSpec.model_validate(cand["spec"])
                cand = self._identify(cand, spec)
                if cand["status"] == "open":
                    live.append(cand)
            elif _next_phase(cand) is None:  # killed between its last step and its row
                last = cand["steps"][-1]
                self._decide(cand, Step(**last), recorded=True)
            else:
                live.append(cand)
        return self._round(live) if live else []

    # ---------------------------------------------------------------------- stopping

    def _same_identity(self, identity: str, other_than: int) -> dict[str, Any] | None:
        """An earlier candidate with this identity: decided, or open in this round. One the
        budget cut before it was judged is no answer: the same stack may be measured."""
        return next(
            (
                c
                for c in self.s.store.list_candidates(self.id)
                if c["identity"] == identity
                and c["id"] != other_than
                and not (c["status"] == "decided" and state.cut_by_budget(c))
            ),
            None,
        )

    def _target_reached(self) -> str | None:
        row = self.s.store.get_exploration(self.id)
        headline = row["champion_headline"]
        if self.s.target is None or headline is None or headline < self.s.target:
            return None
        champion = f"{self.champion.name} at {headline:.2f}x"
        return f"target reached: champion {champion} >= {self.s.target:g}x (paired, vs stock)"

    def _elapsed(self) -> float:
        return self.elapsed0 + (time.monotonic() - self.t0)

    def _spent(self, needs: int, names: list[str | None], phase: str) -> str | None:
        """Why the budget allows no further `needs` `phase` jobs of the candidates `names`
        (None: not measured yet) with the champion and, as planned, stock; or None. A job
        is estimated from what its stacks cost per clip (`_job_seconds`); before that is
        known, per stack (a dev job of five stacks costs about 5/3 of a gate job of three),
        from the jobs so far."""
        stacks = self._job_names(names, phase)
        next_job = self._job_seconds(stacks)
        if next_job is None and self.stack_seconds:
            next_job = statistics.fmean(self.stack_seconds) * len(stacks)
        return self.s.budget.spent(self._elapsed(), self.jobs, next_job, needs, len(stacks))

    def _job_seconds(self, stacks: list[str | None]) -> float | None:
        """A job of `stacks` (`_job_names`): per stack, its seconds per clip (as last
        measured; a candidate not yet measured, the champion's: it is the champion and one
        change) times its clips and warm-ups, plus what a job spends per stack beyond its
        clips (building, fidelity), as measured. On the H200 stock took 7 s a clip and a
        captured loop 1 s, so a job's time follows its host-bound stacks, not its count of
        stacks. None until the champion (and stock, when the job holds it) was timed."""
        stock, champ = self.s.stock.name, self.champion.name
        if not self.extra_s or champ not in self.clip_s:
            return None
        if stock in stacks and stock not in self.clip_s:
            return None
        dev = self.s.dev
        clips = len(dev.prompts) * len(dev.seeds) + dev.warmups
        per_clip = [self.clip_s.get(n or "", self.clip_s[champ]) for n in stacks]
        return sum(statistics.fmean(self.extra_s) + clips * s for s in per_clip)

    def _learn(self, outcome: Outcome, seconds: float, estimates: bool = True) -> None:
        """Seconds per clip of each stack the job timed, and (`estimates`) what the job
        spent per stack beyond its clips and warm-ups: for `_job_seconds`."""
        if outcome.result is None:
            return
        timed, n = 0.0, 0
        warmups = outcome.result.job.workload.warmups
        for r in outcome.result.results:
            if not r.utterances:
                continue
            per_clip = statistics.fmean(u.latency_s for u in r.utterances)
            self.clip_s[r.stack.name] = per_clip
            timed += (len(r.utterances) + warmups) * per_clip
            n += 1
        if estimates and n:
            self.extra_s.append(max(0.0, seconds - timed) / n)

    def _stop(self, why: str) -> str:
        self.close("FINISHED", why)
        return why

    def close(self, status: str, why: str) -> None:
        """End this session: FINISHED with its stop reason, or INTERRUPTED (resumable)."""
        self.s.store.update_exploration(
            self.id, status=status, stop_reason=why, ended_at=utcnow(), elapsed_s=self._elapsed()
        )
        if self.s.track:
            row = self.s.store.get_exploration(self.id)
            self._warn(tracking.finish(self.mlflow_id, row, status))
        self.s.say(f"stopped: {why}")

    def _warn(self, warning: str | None) -> None:
        if warning:
            self.s.warnings.append(warning)


_NUMBER_COLUMNS = (
    "headline",
    "headline_lo",
    "headline_hi",
    "vs_parent",
    "vs_parent_lo",
    "vs_parent_hi",
)


def _best_numbers(steps: list[dict[str, Any]]) -> dict[str, float]:
    """The numbers a candidate is remembered by: each from the latest step that has it (the
    gate's holdout headline over the remeasure's, the remeasure's over the dev job's)."""
    out: dict[str, float] = {}
    for step in steps:
        out.update(step.get("numbers") or {})
    return out


def _last(steps: list[dict[str, Any]], key: str) -> Any:
    return next((s[key] for s in reversed(steps) if s.get(key)), None)


def _next_phase(cand: dict[str, Any]) -> str | None:
    """Where an open candidate goes next: the phase its journal says was in flight (unless
    that phase's step is recorded), the phase its last decision sent it to, its first (dev;
    fresh for a combination), or None (its last step decided it: only its row was not)."""
    last = cand["steps"][-1] if cand["steps"] else None
    if cand["phase"] and not (last and last["phase"] == cand["phase"]):
        return str(cand["phase"])
    if last is not None:
        return NEXT_PHASE.get(last["decision"])
    return "fresh" if cand["proposer"] == COMBINE else "dev"


def _draw(group: list[dict[str, Any]]) -> int:
    """What a job's fresh seeds are drawn from (jobs.fresh_workload): the lowest candidate
    number in it, shifted by RETRY_DRAW when it retries a noisy fresh job (other seeds)."""
    retry = any(_fresh_run_id(c) for c in group)
    return min(c["seq"] for c in group) + (RETRY_DRAW if retry else 0)


def _fresh_run_id(cand: dict[str, Any]) -> str | None:
    """The run of the candidate's latest fresh-seed step, if it had one."""
    return next((s["run_id"] for s in reversed(cand["steps"]) if s["phase"] == "fresh"), None)


def _vs_parent(cand: dict[str, Any]) -> float:
    """The candidate's latest measured speedup over its parent (0 when none)."""
    return float(_best_numbers(cand["steps"]).get("vs_parent") or 0.0)


def _since_gain(candidates: list[dict[str, Any]]) -> int:
    """Decided candidates since the last accept that ran (patience carries over a resume)."""
    n = 0
    for c in candidates:
        if c["status"] != "decided" or (c["decision"] != "accept" and _spends_no_patience(c)):
            continue
        n = 0 if c["decision"] == "accept" else n + 1
    return n


def _spends_no_patience(cand: dict[str, Any]) -> bool:
    """Candidates that say nothing about whether the proposers still find gains: refused on
    this device, cut by the budget before they were judged (a resume takes them on), and
    superseded (they cleared their remeasure; a round-mate was accepted first)."""
    return _refused_here(cand) or state.cut_by_budget(cand) or cand["decision"] == "superseded"


def _refused_here(cand: dict[str, Any]) -> bool:
    return refused_here(cand["decision"], cand["reason"])


def _headline_text(cand: dict[str, Any]) -> str:
    if cand.get("headline") is None:
        return "headline not measured"
    lo, hi = cand.get("headline_lo"), cand.get("headline_hi")
    ci = f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else ""
    return f"{cand['headline']:.2f}x{ci}"
