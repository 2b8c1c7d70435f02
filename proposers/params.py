"""The `params` proposer: Optuna over the champion's technique parameters and the family's
decoding knobs.

The search space is read from each technique's Params model:
- bool and Literal fields are categorical;
- int and float fields bounded on both sides (ge/gt and le/lt) are ranges (an int range
  spanning a factor of 16 or more is searched on a log scale);
- `Field(json_schema_extra={"search": [low, high]})` or `{"search": {"choices": [...]}}`
  narrows or replaces that, for a field whose legal values are wider than worth searching;
- anything else (no bounds, tuples, optionals) keeps its value and is listed as skipped.
The champion's techniques are all kept (leaving one out is `ablation`'s move). The family's
decoding knobs (techniques that claim only `knob.*` slots) that the champion lacks are one
on/off choice each, their fields searched when on.

TPE maximises the headline (paired speedup over the root). With options["objectives"] ==
["speed", METRIC], NSGA-II trades it against Tried.quality[METRIC], minimised when the name
says error or distance (wer, cer, ...), else maximised (options["quality_direction"]).
Trials live in Optuna's storage inside the project's database (options["storage_url"],
the store's SQLAlchemy URL), study "<exploration>-params", so a resumed exploration goes on
with its study. Outcomes: measured -> COMPLETE with the headline; "retain" (the gate kept
the champion) is COMPLETE but infeasible, so the search leaves regions that only look fast;
invalid or error -> FAIL; a stack already tried -> its earlier outcome again (or PRUNED).

Options: storage_url, exploration (id), study_name, seed (0), objectives (["speed"]),
quality_direction, startup_trials (10), population (10, NSGA-II), patience (50 asks per
call before the space counts as exhausted).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import annotated_types as at
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import Trial, TrialState
from pydantic.fields import FieldInfo

from orchestrate.api.config import StackSpec, TechniqueRef
from orchestrate.api.proposer import ExplorationState, Proposal, Proposer, ProposerError, Tried
from orchestrate.api.registry import StackError, build_stack, get

KNOB_SLOT = "knob."
FAILED = ("invalid", "error")
LOWER_IS_BETTER = ("wer", "cer", "err", "dist", "loss", "kl", "mcd")
optuna.logging.set_verbosity(optuna.logging.WARNING)  # the loop prints its own progress


# ------------------------------------------------------------------- search space


@dataclass(frozen=True)
class Dim:
    technique: str
    field: str | None  # None: a knob's on/off choice
    distribution: BaseDistribution
    default: Any = None  # the field's default, to tell a change from a restatement

    @property
    def key(self) -> str:
        return self.technique if self.field is None else f"{self.technique}.{self.field}"


@dataclass(frozen=True)
class Space:
    dims: list[Dim]
    knobs: list[str]  # decoding knobs the champion lacks, appended when switched on
    skipped: list[str]  # "technique.field" kept at its value


def distribution(annotation: Any, info: FieldInfo) -> BaseDistribution | None:
    """The range of one Params field, or None when it declares none."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    hint = extra.get("search")
    if isinstance(hint, dict) and hint.get("choices"):
        return CategoricalDistribution(list(hint["choices"]))
    if annotation is bool:
        return CategoricalDistribution([False, True])
    if get_origin(annotation) is Literal:
        return CategoricalDistribution(list(get_args(annotation)))
    if annotation not in (int, float):
        return None
    low, high = hint if isinstance(hint, list | tuple) else _bounds(info, annotation)
    if low is None or high is None or low > high:
        return None
    if annotation is int:
        low, high = math.ceil(low), math.floor(high)
        return IntDistribution(low, high, log=low >= 1 and high >= 16 * low)
    return FloatDistribution(float(low), float(high))


def _bounds(info: FieldInfo, kind: type) -> tuple[float | None, float | None]:
    low = high = None
    for m in info.metadata:
        if isinstance(m, at.Ge):
            low = m.ge
        elif isinstance(m, at.Gt):  # open bounds: the nearest legal value
            low = m.gt + 1 if kind is int else math.nextafter(m.gt, math.inf)
        elif isinstance(m, at.Le):
            high = m.le
        elif isinstance(m, at.Lt):
            high = m.lt - 1 if kind is int else math.nextafter(m.lt, -math.inf)
    return low, high


def _fields(name: str) -> tuple[list[Dim], list[str]]:
    try:
        params = get(name).Params
    except StackError:
        return [], [f"{name}.*"]
    dims, skipped = [], []
    for field, info in params.model_fields.items():
        dist = distribution(info.annotation, info)
        if dist is None:
            skipped.append(f"{name}.{field}")
        else:
            dims.append(Dim(name, field, dist, info.default))
    return dims, skipped


def _is_knob(meta: dict[str, Any]) -> bool:
    slots = list(meta.get("slots", ())) + list(meta.get("wraps", ()))
    return bool(slots) and all(s.startswith(KNOB_SLOT) for s in slots)


def _fits(name: str, meta: dict[str, Any], state: ExplorationState) -> bool:
    """Whether knob `name` can join the champion: device, slots, conflicts, order."""
    champion = {t.name for t in state.champion.techniques}
    claimed = {s for t in champion for s in state.catalogue.get(t, {}).get("slots", ())}
    if any(r not in state.device_caps for r in meta.get("requires", ())):
        return False
    if claimed & set(meta.get("slots", ())) or champion & set(meta.get("conflicts", ())):
        return False
    if any(name in state.catalogue.get(t, {}).get("conflicts", ()) for t in champion):
        return False
    return set(meta.get("after", ())) <= champion


def search_space(state: ExplorationState) -> Space:
    dims: list[Dim] = []
    skipped: list[str] = []
    for ref in state.champion.techniques:
        found, left = _fields(ref.name)
        dims += found
        skipped += left
    knobs = []
    champion = {t.name for t in state.champion.techniques}
    for name, meta in sorted(state.catalogue.items()):
        if name in champion or not _is_knob(meta) or not _fits(name, meta, state):
            continue
        found, left = _fields(name)
        skipped += left
        if found:  # a knob with nothing to search would only add its default
            knobs.append(name)
            dims += [Dim(name, None, CategoricalDistribution([False, True])), *found]
    return Space(dims, knobs, skipped)


def identity(stack: StackSpec) -> str:
    """What makes two stacks the same experiment here: techniques in order with their
    validated params (defaults filled in), whatever the stacks are called."""
    parts = []
    for ref in stack.techniques:
        try:
            params = get(ref.name).Params.model_validate(ref.params).model_dump(mode="json")
        except Exception:  # unknown or invalid: compare as written
            params = ref.params
        parts.append([ref.name, params])
    return json.dumps([stack.family, parts], sort_keys=True)


# ----------------------------------------------------------------------- proposer


class ParamsProposer(Proposer):
    name = "params"
    summary = "Optuna (TPE; NSGA-II for speed vs quality) over technique params and knobs"
    reads_headlines = True  # every trial's objective is its headline, dropped ones too

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.objectives: list[str] = list(self.options.get("objectives", ["speed"]))
        if self.objectives[:1] != ["speed"] or len(self.objectives) > 2:
            raise ProposerError(
                f"params: objectives must be ['speed'] or ['speed', METRIC], got {self.objectives}"
            )
        self.seed = int(self.options.get("seed", 0))
        self.patience = int(self.options.get("patience", 50))
        self._study: optuna.Study | None = None
        self._pending: dict[str, int] = {}  # identity -> trial number, asked this process
        self._infeasible: set[int] = set()  # trial numbers the gate turned down
        self._known: dict[str, Tried] = {}  # identity -> outcome, from the last state
        self.last_space: Space | None = None

    # -------------------------------------------------------------- the study

    @property
    def quality(self) -> str | None:
        return self.objectives[1] if len(self.objectives) == 2 else None

    def study(self) -> optuna.Study:
        if self._study is not None:
            return self._study
        directions = ["maximize"]
        if self.quality:
            lower = any(w in self.quality.lower() for w in LOWER_IS_BETTER)
            default = "minimize" if lower else "maximize"
            directions.append(self.options.get("quality_direction", default))
        study = optuna.create_study(
            storage=self._storage(),
            study_name=self._study_name(),
            directions=directions,
            load_if_exists=True,
        )
        # Seeded by the trials already there: a resumed study does not replay its draws.
        study.sampler = self._sampler(self.seed + len(study.trials))
        self._study = study
        return study

    def _sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        def constraints(trial: optuna.trial.FrozenTrial) -> tuple[float]:
            return (1.0 if trial.number in self._infeasible else 0.0,)

        # constraints_func: experimental in optuna 4, deprecated in 5 for
        # Trial.set_constraint (5 only, and it needs the Trial object, which a resumed
        # exploration no longer has), removed in 7: hence optuna<7.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.simplefilter("ignore", FutureWarning)
            if self.quality:
                return optuna.samplers.NSGAIISampler(
                    seed=seed,
                    population_size=int(self.options.get("population", 10)),
                    constraints_func=constraints,
                )
            return optuna.samplers.TPESampler(
                seed=seed,
                n_startup_trials=int(self.options.get("startup_trials", 10)),
                constraints_func=constraints,
            )

    def _study_name(self) -> str:
        if "study_name" in self.options:
            return str(self.options["study_name"])
        return f"{self.options.get('exploration', 'exploration')}-params"

    def _storage(self) -> optuna.storages.BaseStorage:
        url = self.options.get("storage_url")
        if not url:
            return optuna.storages.InMemoryStorage()
        _check_project_schema(url)
        kwargs = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {}
        # Optuna and the project both keep their schema revision in `alembic_version`; the
        # project's is there first, so Optuna's own check must not compare against it.
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_compatibility_check=True)

    # ---------------------------------------------------------------- propose

    def propose(self, state: ExplorationState, n: int) -> list[Proposal]:
        space = self.last_space = search_space(state)
        if not space.dims or n <= 0:
            return []
        study = self.study()
        self._known = {identity(t.stack): t for t in state.tried}
        champion = identity(state.champion)
        out: list[Proposal] = []
        batch: set[str] = set()
        for _ in range(self.patience):
            if len(out) >= n:
                break
            trial = study.ask()
            stack, change = self._sample(trial, space, state)
            key = identity(stack)
            trial.set_user_attr("identity", key)
            if key in self._known:
                self._tell(trial.number, self._known[key])
            elif key == champion:
                self._tell_champion(trial.number, state)
            elif key in batch:
                study.tell(trial.number, state=TrialState.PRUNED)
            elif why := _invalid(stack):
                trial.set_user_attr("why", why)
                study.tell(trial.number, state=TrialState.FAIL)
            else:
                batch.add(key)
                self._pending[key] = trial.number
                out.append(Proposal(stack=stack, change=change, reason=self._reason(trial, space)))
        return out

    def _sample(self, trial: Trial, space: Space, state: ExplorationState) -> tuple[StackSpec, str]:
        champ = state.champion
        params = {t.name: dict(t.params) for t in champ.techniques}
        changed: dict[str, list[str]] = {}
        for dim in space.dims:
            if dim.field is None:  # a knob's on/off choice comes before its fields
                if _suggest(trial, dim):
                    params[dim.technique] = {}
                    changed[dim.technique] = []
                continue
            if dim.technique not in params:
                continue  # a knob left off: its fields are not drawn
            value = _suggest(trial, dim)
            before = params[dim.technique].get(dim.field, dim.default)
            params[dim.technique][dim.field] = value
            if value != before or dim.technique in space.knobs:
                changed.setdefault(dim.technique, []).append(f"{dim.field}={_short(value)}")
        names = [t.name for t in champ.techniques] + [k for k in space.knobs if k in params]
        stack = StackSpec(
            name=_stack_name(f"{champ.name}.p{trial.number}"),
            family=champ.family,
            description=f"params trial {trial.number} from {champ.name}",
            techniques=[TechniqueRef(name=n, params=params[n]) for n in names],
        )
        change = ", ".join(
            f"+{t}({', '.join(fields)})" if t in space.knobs else f"{t}: {', '.join(fields)}"
            for t, fields in changed.items()
        )
        return stack, change or "(no change)"

    def _reason(self, trial: Trial, space: Space) -> str:
        sampler = "NSGA-II" if self.quality else "TPE"
        why = f"{sampler} trial {trial.number} over {len(space.dims)} parameter(s)"
        if space.skipped:
            why += f" (kept as set, no range: {', '.join(space.skipped)})"
        return why

    # ---------------------------------------------------------------- observe

    def observe(self, proposal: Proposal, tried: Tried) -> None:
        key = identity(proposal.stack)
        number = self._pending.pop(key, None)
        if number is None:  # asked before a restart: find it in the storage
            running = self.study().get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            number = next((t.number for t in running if t.user_attrs.get("identity") == key), None)
        if number is not None:
            self._tell(number, tried)

    def _tell(self, number: int, tried: Tried) -> None:
        study = self.study()
        state, values = self._outcome(tried)
        if tried.decision == "retain":
            self._infeasible.add(number)
        study.tell(number, values, state=state, skip_if_finished=True)

    def _tell_champion(self, number: int, state: ExplorationState) -> None:
        study = self.study()
        if state.champion_headline is None or self.quality:  # its quality is not in the state
            study.tell(number, state=TrialState.PRUNED)
        else:
            study.tell(number, [state.champion_headline])

    def _outcome(self, tried: Tried) -> tuple[TrialState, list[float] | None]:
        if tried.decision in FAILED:
            return TrialState.FAIL, None
        if tried.decision == "duplicate":
            earlier = self._known.get(identity(tried.stack))
            if earlier is None or earlier.decision == "duplicate":
                return TrialState.PRUNED, None
            return self._outcome(earlier)
        if tried.headline is None:
            return TrialState.FAIL, None
        values = [tried.headline]
        if self.quality:
            if self.quality not in tried.quality:  # not scored: no point on the front
                return TrialState.FAIL, None
            values.append(tried.quality[self.quality])
        return TrialState.COMPLETE, values


def _suggest(trial: Trial, dim: Dim) -> Any:
    d = dim.distribution
    if isinstance(d, CategoricalDistribution):
        return trial.suggest_categorical(dim.key, d.choices)
    if isinstance(d, IntDistribution):
        return trial.suggest_int(dim.key, d.low, d.high, log=d.log)
    assert isinstance(d, FloatDistribution)
    return trial.suggest_float(dim.key, d.low, d.high, log=d.log)


def _invalid(stack: StackSpec) -> str | None:
    try:
        build_stack(stack)  # params, slots, order, check_stack: no model is built
    except StackError as exc:
        return str(exc)
    return None


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _stack_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", name)


def _check_project_schema(url: str) -> None:
    """Refuse a database the project has not created yet: Optuna would stamp its own
    revision into `alembic_version`, which the project's store then refuses to open."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            if (
                not sa.inspect(conn).has_table("alembic_version")
                or not conn.execute(sa.text("SELECT version_num FROM alembic_version")).first()
            ):
                raise ProposerError(
                    f"params: {url} has no orchestrate schema yet; open it with the "
                    "project's store first (Optuna's tables go into the same database)"
                )
    finally:
        engine.dispose()
