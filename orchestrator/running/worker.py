"""Execute one job: build the model once, build each stack's engine, warm up, then time all
stacks interleaved, and write a result record. Needs torch, transformers, pydantic and the
project only (no database, no MLflow): run it here, in a subprocess, or on a GPU host with
`orchestrate worker JOB.json`.

Progress goes to stdout as JSON lines ({"event": ...}) for the orchestrator's progress bar.
`--serve` keeps one worker up for many jobs (running.warm, for `orchestrate explore`): it reads
one request per stdin line, answers each with an {"event": "exit"} line, and keeps the built
model between jobs (ModelCache: only while its checksum is unchanged).
Each timed utterance is also appended to utterances.jsonl in the job folder (flushed and
fsynced before the next is timed), so a worker killed half-way loses nothing it measured:
`orchestrate run --resume RUN` carries those records into a fresh worker (JobSpec.carried),
which skips them and times the rest.

Test hook: ORCHESTRATE_FAULT (read here only) makes this worker fail on purpose, for the
fault-injection tests: `kill_at:PHASE` sends itself SIGKILL, `enospc_at:PHASE` raises
OSError(ENOSPC) as a full disk would, `kill_after_utterances:N` SIGKILLs itself once it has
timed N utterances. PHASE is build, warmup, fidelity, timing (after the first utterance is
in utterances.jsonl) or result_write (before result.json is written).
"""

from __future__ import annotations

import argparse
import errno
import gc
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from orchestrate.api import sealed
from orchestrate.api.config import LengthPolicy
from orchestrate.api.paths import inside
from orchestrate.api.records import JobSpec, ResultRecord, StackResult, UtteranceRecord, utcnow
from orchestrate.api.registry import StackError, build_stack, get_family
from orchestrate.api.technique import DeviceCaps, Refused
from orchestrate.running import environment, guards
from orchestrate.running import serving as serving_job
from orchestrate.running.audio import integrity, write_wav
from orchestrate.running.gpu_memory import StackMemory
from orchestrate.running.metrics import point_metrics, summarize


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def memory(phase: str) -> None:
    """GPU memory held by this process after `phase` (an event; nothing on a CPU): where a
    process-wide peak comes from, phase by phase."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        emit(
            "memory",
            phase=phase,
            allocated_bytes=torch.cuda.memory_allocated(),
            peak_bytes=torch.cuda.max_memory_allocated(),
            reserved_bytes=torch.cuda.memory_reserved(),
        )


JOURNAL = "utterances.jsonl"
PHASES = ("build", "warmup", "fidelity", "timing", "result_write")


def device_name(device: str) -> str:
    """The device as EnvironmentInfo.device_name records it (environment.capture): a resume
    refuses to mix utterances timed on another one."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"


class Journal:
    """utterances.jsonl: one line per timed utterance, {"stack", "device_name",
    "utterance"}, written through to the disk before the next one is timed."""

    def __init__(self, path: Path, device: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.device = path, device_name(device)

    def append(self, stack: str, utt: UtteranceRecord) -> None:
        line = {"stack": stack, "device_name": self.device, "utterance": utt.model_dump()}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())  # a kill (or a power cut) after this loses nothing


def read_journal(path: Path) -> list[tuple[str, str, UtteranceRecord]]:
    """(stack, device name, record) per line of a journal; a line a kill cut short (or any
    line that does not parse) is left out: it was never a whole measurement."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            out.append((row["stack"], row["device_name"], UtteranceRecord(**row["utterance"])))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def _fault_spec() -> tuple[str, str] | None:
    """ORCHESTRATE_FAULT as (kind, argument); a value it does not know is an error, so a
    typo never lets a fault test pass without its fault."""
    raw = os.environ.get("ORCHESTRATE_FAULT", "").strip()
    if not raw:
        return None
    kind, _, arg = raw.partition(":")
    ok = (kind in ("kill_at", "enospc_at") and arg in PHASES) or (
        kind == "kill_after_utterances" and arg.isdigit()
    )
    if not ok:
        raise ValueError(
            f"ORCHESTRATE_FAULT={raw!r} is not a fault (a test hook): kill_at:PHASE, "
            f"enospc_at:PHASE (PHASE: {', '.join(PHASES)}) or kill_after_utterances:N"
        )
    return kind, arg


def _fault(phase: str, path: Path, timed: int = 0) -> None:
    """The test hook: fail here as ORCHESTRATE_FAULT asks (nothing when it is unset)."""
    spec = _fault_spec()
    if spec is None:
        return
    kind, arg = spec
    if (kind == "kill_at" and arg == phase) or (
        kind == "kill_after_utterances" and phase == "timing" and timed >= int(arg)
    ):
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "enospc_at" and arg == phase:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


class ModelCache:
    """The model of the last job, for the next one of the same ModelSpec (a warm worker).

    Stacks of one job already share one model, so techniques must leave it as built; a
    plugin that edits it in place would leak into every later job. A checksum of every
    tensor (its sum and sum of squares, in float64) taken at build is compared before each
    reuse; a changed model is built again, and a model without torch tensors (Piper's ONNX
    graphs) is never reused.
    """

    def __init__(self) -> None:
        self.key: str | None = None
        self.model: Any = None
        self.checksum: list[float] | None = None
        self.build_s: float | None = None  # the kept model's build time
        self.reused = False  # whether the last get() served the kept model

    def get(self, family: Any, spec: Any) -> Any:
        key = spec.model_dump_json()
        if self.key == key and self.model is not None:
            if checksum(self.model) == self.checksum:
                emit(
                    "status",
                    message=f"reusing {spec.preset} from the last job (checksum unchanged; "
                    f"its build took {self.build_s:.1f} s)",
                )
                self.reused = True
                return self.model
            emit("status", message=f"{spec.preset} changed since the last job: building it again")
        self.key = self.model = self.checksum = None
        self.reused = False
        release()
        t0 = time.perf_counter()
        model = build(family, spec)
        self.build_s = time.perf_counter() - t0
        self.checksum = checksum(model)
        if self.checksum is not None:
            self.key, self.model = key, model
        return model


def build(family: Any, spec: Any) -> Any:
    emit("status", message=f"building {spec.preset} on {spec.device}")
    return family.build_model(spec)


def checksum(model: Any) -> list[float] | None:
    """Sum and sum of squares of every tensor the model's torch modules hold, in float64
    (one tensor's float64 copy at a time; on the H200, build and checksum of rumik-oss-1
    together took under a second); None when it holds none, or is not an object with
    attributes (a third-party family's model may be anything)."""
    if isinstance(model, torch.nn.Module):
        modules = [model]
    else:
        try:
            fields = vars(model).values()
        except TypeError:  # no __dict__: __slots__, a tuple, a C object
            return None
        modules = [v for v in fields if isinstance(v, torch.nn.Module)]
    tensors = [t for m in modules for t in m.state_dict(keep_vars=True).values()]
    if not tensors:
        return None
    with torch.no_grad():
        sums = []
        for t in tensors:
            d = t.detach().double()
            sums.append(torch.stack([d.sum(), d.square().sum()]).cpu())
        return torch.cat(sums).tolist()


def release() -> None:
    """Free what the last job's engines held (CUDA graphs keep pools until collected)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_job(job: JobSpec, models: ModelCache | None = None) -> ResultRecord:
    started = utcnow()
    family = get_family(job.model.family)
    out_dir = Path(job.output_dir)
    journal = Journal(out_dir / JOURNAL, job.model.device)
    for name, utts in job.carried.items():  # first: a resume killed again keeps them too
        for utt in utts:
            journal.append(name, utt.model_copy(update={"resumed": True}))
    _fault("build", out_dir)
    t0 = time.perf_counter()
    model = build(family, job.model) if models is None else models.get(family, job.model)
    reused = models is not None and models.reused
    build_s = models.build_s if reused and models is not None else time.perf_counter() - t0
    memory("model built")
    caps = DeviceCaps.probe(job.model.device)
    device = torch.device(job.model.device)
    per_stack = StackMemory(device)  # what each stack needs, not the process's peak
    per_stack.model_built()

    results: dict[str, StackResult] = {}
    engines: dict[str, Any] = {}
    for spec in job.stacks:
        try:
            built = build_stack(spec, caps, strict=job.strict)
        except StackError as exc:
            results[spec.name] = StackResult(stack=spec, status="refused", error=str(exc))
            continue
        t0 = time.perf_counter()
        try:
            # No autograd while building: a technique that derives tensors from parameters
            # (int8 quantization) would otherwise keep their whole graph alive, fp32
            # intermediates included: 25.4 GB of exp74-full's 32.5 GB on the H200.
            with torch.no_grad(), per_stack.holding(spec.name):
                engines[spec.name] = family.build_engine(model, built)
            memory(f"engine {spec.name} built")
        except Refused as exc:
            results[spec.name] = StackResult(stack=spec, status="refused", error=str(exc))
            continue
        except Exception as exc:
            results[spec.name] = StackResult(stack=spec, status="failed", error=_describe(exc))
            continue
        results[spec.name] = StackResult(
            stack=spec,
            status="partial" if built.partial else "ok",
            applied=[t.ref() for t in built.techniques],
            skipped=built.skipped,
            exact=built.exact,
            setup_s=time.perf_counter() - t0,
        )

    wl = sealed.resolve(job.workload, job.sealed_file)  # holdout texts: in memory only
    serving = wl.load is not None  # many streams at once: per-stream figures, no utterances
    _fault("warmup", out_dir)
    if not serving:
        _warm_up(family, engines, results, wl, per_stack)
    memory("warmed up")
    _fault("fidelity", out_dir)
    # A serving stack's fidelity teacher-forces its server's step in one row of a small
    # server beside other rows (the family's fidelity); its timed server is built later.
    if job.fidelity_steps and engines:
        emit("status", message="teacher-forced fidelity against stock")
        # A report, not a reason to lose the timings; a failure is its stack's own error.
        found, errors = guards.fidelity_per_stack(
            family, model, engines, wl, job.fidelity_steps, _describe
        )
        for name, rec in found.items():
            results[name].fidelity = rec
        for name, why in errors.items():
            results[name].fidelity_error = why
            emit("status", message=f"fidelity failed for {name}: {why}")

    memory("fidelity done")
    served = _serve(family, engines, results, wl, out_dir, per_stack) if serving else {}
    pairs = [] if serving else list(itertools.product(wl.prompts, wl.seeds))
    total = len(pairs) * len(engines)
    carried = _carry(job, results)
    done, timed = len(carried), 0
    # Recordings a resumed run saved already count against save_audio.
    saved = {n: sum(u.audio_path is not None for u in results[n].utterances) for n in engines}
    prints = guards.AudioPrints()  # does a stack's audio depend on its input?
    host_ms = environment.single_thread_ms()  # measured once, before any utterance is timed
    for rnd, (prompt, seed) in enumerate(pairs):
        names = list(engines)
        order = names[rnd % len(names) :] + names[: rnd % len(names)]  # rotate: no fixed first
        for name in order:
            if results[name].status == "failed" or (name, prompt.id, seed) in carried:
                continue
            try:
                with per_stack.timing(name):  # resets the peak: peak_memory_bytes reads it
                    syn = family.synthesize(engines[name], prompt.text, seed, wl)
                guards.check_waveform(syn)  # on the host, finite, not empty: inside its time
                ttfa = _time_to_first_audio(family, engines[name], prompt.text, seed, wl)
            except Exception as exc:
                results[name].status = "failed"
                results[name].error = f"{prompt.id}/seed {seed}: {_describe(exc)}"
                continue
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
                results[name].peak_memory_bytes = max(results[name].peak_memory_bytes or 0, peak)
            audio_path = None
            if saved[name] < wl.save_audio:
                rel = Path(name) / f"{prompt.id}_s{seed}.wav"
                write_wav(inside(out_dir, rel), syn.audio, syn.sample_rate)
                audio_path, saved[name] = str(rel), saved[name] + 1
            prints.add(name, prompt.id, prompt.text, seed, rnd, syn.audio, syn.sample_rate)
            utt = _utterance(syn, prompt.id, seed, rnd, audio_path, ttfa, host_ms, job.job_id)
            journal.append(name, utt)  # on disk before anything else can go wrong
            results[name].utterances.append(utt)
            done, timed = done + 1, timed + 1
            memory(f"timed {name} {prompt.id}/{seed}")
            emit("progress", done=done, total=total, stack=name, latency_s=syn.latency_s)
            _fault("timing", journal.path, timed)

    for res in results.values():  # carried and new in the rotation's order
        res.utterances.sort(key=lambda u: u.round)

    launches = (
        {} if serving else _launch_metrics(family, engines, results, wl, device, job.count_launches)
    )
    slot_ms = {} if serving else _slot_metrics(job, family, engines, results, wl)
    env = environment.capture(job.model.device, family.config_hash(model), _dtype(job))
    env = env.model_copy(update={"model_reused": reused, "model_build_s": build_s})
    for name, res in results.items():
        res.metrics = summarize(res.utterances)
        res.metrics.update(point_metrics(res.utterances, wl))
        if name in engines:
            res.metrics.update(_floor_metrics(family, engines[name], res, env.copy_gb_s))
            res.metrics.update(launches.get(name, {}))
            res.metrics.update(slot_ms.get(name, {}))
            res.metrics.update(_forward_metrics(res, env))
            res.metrics.update(per_stack.metrics(name))
            res.metrics.update(served.get(name, {}))
        res.audio_independent_of_input = prints.find(name)
        guards.mark(res)  # faster than its floor: invalid; every guard's verdict in metrics
    statuses = {r.status for r in results.values()}
    status = (
        "finished"
        if statuses <= {"ok"}
        else "failed"
        if statuses <= {"failed", "refused"}
        else "partial"
    )
    return ResultRecord(
        job=job,
        status=status,
        started_at=started,
        finished_at=utcnow(),
        environment=env,
        results=[results[s.name] for s in job.stacks],
    )


def _serve(
    family: Any,
    engines: dict[str, Any],
    results: dict[str, StackResult],
    wl: Any,
    out_dir: Path,
    per_stack: StackMemory,
) -> dict[str, dict[str, float]]:
    """The workload's load on each stack in turn (one server in memory at a time): its
    `serve.*` metrics by stack; each stack's streams in `<stack>/serving.json`."""
    out: dict[str, dict[str, float]] = {}
    for i, name in enumerate(engines):
        emit("status", message=f"serving {wl.load.label()} on {name}")
        try:
            with per_stack.timing(name):
                out[name], results[name].warmup_s = serving_job.serve_stack(
                    family, engines[name], wl, inside(out_dir, Path(name) / "serving.json")
                )
        except Exception as exc:
            results[name].status = "failed"
            results[name].error = f"serving {wl.load.label()}: {_describe(exc)}"
            continue
        release()  # the server's cache and graphs go before the next stack's
        m = out[name]
        served, streams = int(m.get("serve.served", 0)), int(m.get("serve.streams", 0))
        ttfa = m.get("serve.ttfa_p95_s")
        ttfa_text = "none" if ttfa is None else f"{ttfa:.3f} s"
        emit(
            "status",
            message=f"served {name} ({i + 1}/{len(engines)}): {served}/{streams} streams with "
            f"no late chunk, first audio p95 {ttfa_text}",
        )
    return out


def _carry(job: JobSpec, results: dict[str, StackResult]) -> set[tuple[str, str, int]]:
    """Attach what the resumed run measured (job.carried) to the stacks' results, marked
    resumed; returns their (stack, prompt, seed), which the timed rounds skip."""
    keys: set[tuple[str, str, int]] = set()
    for name, utts in job.carried.items():
        for utt in utts:
            key = (name, utt.prompt_id, utt.seed)
            if name in results and key not in keys:
                results[name].utterances.append(utt.model_copy(update={"resumed": True}))
                keys.add(key)
    return keys


def _utterance(
    syn: Any,
    prompt_id: str,
    seed: int,
    rnd: int,
    audio_path: str | None,
    ttfa: float | None,
    host_ms: float,
    timed_by: str,
) -> UtteranceRecord:
    return UtteranceRecord(
        prompt_id=prompt_id,
        seed=seed,
        round=rnd,
        latency_s=syn.latency_s,
        lm_s=syn.lm_s,
        codec_s=syn.codec_s,
        prefill_s=syn.prefill_s,
        prompt_tokens=syn.prompt_tokens,
        new_tokens=syn.new_tokens,
        frames=syn.frames,
        audio_s=syn.audio.size / syn.sample_rate,
        stop_reason=syn.stop_reason,
        audio_path=audio_path,
        time_to_first_audio_s=ttfa,
        forward_passes=syn.forward_passes,
        forward_bytes=syn.forward_bytes,
        forward_flops=syn.forward_flops,
        host_loop_ms=host_ms,
        timed_by=timed_by,
        **integrity(syn.audio),
    )


def _warm_up(
    family: Any,
    engines: dict[str, Any],
    results: dict[str, StackResult],
    wl: Any,
    per_stack: StackMemory,
) -> None:
    """Warm-ups are outside the timer: first-call compilation, graph capture, allocator.

    Longest clip first: a sequence length first reached inside the timed rounds costs
    whichever stack gets there first (new shapes, cache growth), which would bias the
    comparison toward the others.
    """
    longest = sorted(wl.prompts, key=lambda p: -(wl.length_policy.frames_for(p.text) or 0))
    for name, engine in engines.items():
        emit("status", message=f"warming up {name} ({wl.warmups}x)")
        t0 = time.perf_counter()
        try:
            with per_stack.holding(name):  # static caches, captured graphs: its own
                for i in range(wl.warmups):
                    family.synthesize(engine, longest[i % len(longest)].text, wl.seeds[0], wl)
        except Exception as exc:
            results[name].status = "failed"
            results[name].error = f"warm-up: {_describe(exc)}"
        results[name].warmup_s = time.perf_counter() - t0


def _floor_metrics(
    family: Any, engine: Any, res: StackResult, copy_gb_s: float | None
) -> dict[str, float]:
    """Achieved bandwidth and fraction of the physical floor, per generated token.

    ms_per_token is LM time over tokens (prefill, sampling and host work included), so the
    fraction says how far the whole token loop is from moving its bytes at copy speed.
    """
    if not res.utterances or "ms_per_token" not in res.metrics:
        return {}
    context = statistics.mean(u.prompt_tokens + u.new_tokens / 2 for u in res.utterances)
    nbytes = family.step_bytes(engine, context)
    if not nbytes:
        return {}
    seconds = res.metrics["ms_per_token"] / 1e3
    out = {"gb_per_step": nbytes / 1e9, "achieved_gb_s": nbytes / 1e9 / seconds}
    if copy_gb_s:
        out["floor_ms_per_token"] = nbytes / (copy_gb_s * 1e9) * 1e3
        out["fraction_of_floor"] = out["floor_ms_per_token"] / res.metrics["ms_per_token"]
    return out


def _dtype(job: JobSpec) -> torch.dtype:
    return getattr(torch, job.model.dtype)


def _forward_metrics(res: StackResult, env: Any) -> dict[str, float]:
    """Families that run whole-sequence forwards (OmniVoice's unmasking steps): time per
    forward against its floor, max(bytes / copy bandwidth, FLOPs / matmul throughput)."""
    utts = [u for u in res.utterances if u.forward_passes and u.forward_bytes]
    if not utts:
        return {}
    ms = [1e3 * u.lm_s / u.forward_passes for u in utts]  # type: ignore[operator]
    out = {
        "forwards_per_utterance": statistics.median(u.forward_passes for u in utts),  # type: ignore[misc]
        "ms_per_forward": statistics.median(ms),
        "gb_per_forward": statistics.median(u.forward_bytes for u in utts) / 1e9,  # type: ignore[misc]
        "tflop_per_forward": statistics.median(u.forward_flops or 0 for u in utts) / 1e12,
    }
    if env.copy_gb_s and env.matmul_tflop_s:
        floors = [
            1e3 * max(u.forward_bytes / (env.copy_gb_s * 1e9),  # type: ignore[operator]
                      (u.forward_flops or 0) / (env.matmul_tflop_s * 1e12))
            for u in utts
        ]  # fmt: skip
        out["floor_ms_per_forward"] = statistics.median(floors)
        out["forward_fraction_of_floor"] = out["floor_ms_per_forward"] / out["ms_per_forward"]
    return out


def _launch_metrics(
    family: Any,
    engines: dict[str, Any],
    results: dict[str, StackResult],
    wl: Any,
    device: torch.device,
    job_counts: list[str] | None = None,
) -> dict[str, dict[str, float]]:
    """kernels_per_step and launches_per_step per stack (GPU only; the stacks the job names
    in count_launches, or all), after the timed rounds so the profiler cannot disturb them.
    A failed count is reported, not fatal."""
    count = getattr(family, "launches_per_step", None)
    if count is None or device.type != "cuda":
        return {}
    out: dict[str, dict[str, float]] = {}
    wanted = job_counts if job_counts is not None else list(engines)
    for name, engine in engines.items():
        if results[name].status == "failed" or name not in wanted:
            continue
        emit("status", message=f"counting kernel launches per step: {name}")
        try:
            counts = count(engine, wl.prompts[0].text, wl.seeds[0], wl)
        except Exception as exc:
            emit("status", message=f"launch count for {name} failed: {_describe(exc)}")
            continue
        if counts:
            out[name] = counts
    return out


def _slot_metrics(
    job: JobSpec, family: Any, engines: dict[str, Any], results: dict[str, StackResult], wl: Any
) -> dict[str, dict[str, float]]:
    """slot_ms.<slot> per stack when the job asks (profile_slots): each slot's own time per
    step. After the timed rounds: its timers synchronise every call. A family that does not
    profile returns {}; a failed profile is reported, not fatal."""
    if not job.profile_slots:
        return {}
    out: dict[str, dict[str, float]] = {}
    for name, engine in engines.items():
        if results[name].status == "failed":
            continue
        emit("status", message=f"timing slots: {name}")
        try:
            ms = family.slot_profile(engine, wl.prompts[0].text, wl.seeds[0], wl)
        except Exception as exc:
            emit("status", message=f"slot profile of {name} failed: {_describe(exc)}")
            continue
        out[name] = {f"slot_ms.{slot}": v for slot, v in ms.items()}
    return out


def _time_to_first_audio(family: Any, engine: Any, text: str, seed: int, wl: Any) -> float | None:
    """A one-frame synthesis through the same code path: prefill, 8 tokens, codec."""
    if not wl.measure_ttfa:
        return None
    one_frame = wl.model_copy(update={"length_policy": LengthPolicy(mode="fixed", frames=1)})
    return family.synthesize(engine, text, seed, one_frame).latency_s


def _describe(exc: BaseException) -> str:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return f"OOM: {exc}"
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate-worker", description=__doc__)
    parser.add_argument("job", type=Path, nargs="?", help="job JSON (not with --serve)")
    parser.add_argument("--out", type=Path, help="result JSON path (default: next to the job)")
    parser.add_argument("--serve", action="store_true", help="run the jobs stdin names")
    args = parser.parse_args(argv)
    _fault_spec()  # a malformed hook fails before anything is built
    if args.serve:
        return serve()
    if args.job is None:
        parser.error("a job JSON, or --serve")
    job = JobSpec.model_validate_json(args.job.read_text())
    rc, _ = run_one(job, args.out or args.job.with_name(f"result-{job.job_id}.json"))
    return rc


def run_one(job: JobSpec, out: Path, models: ModelCache | None = None) -> tuple[int, bool]:
    """Run `job` and write its result to `out`: (exit status, whether every stack that was
    built ran without failing: after a failure a warm worker ends, see `serve`)."""
    try:
        result = run_job(job, models)
        _fault("result_write", out)
        result.write(out)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        out.with_name(out.name + ".partial").unlink(missing_ok=True)
        emit("error", message=disk_full(exc, out))
        return 1, False
    emit("done", result=str(out), status=result.status)
    clean = all(r.status != "failed" for r in result.results)
    return (0 if result.status != "failed" else 1), clean


def serve() -> int:
    """A warm worker: one request per stdin line, {"job", "out", "log"}; the job's stderr
    goes to its own log, and an {"event": "exit", "rc"} line ends each answer. The built
    model stays for the next job (ModelCache). After a job with a failed stack or an
    exception this worker ends: a CUDA error can leave the process unusable, so the next
    job gets a fresh one (running.warm starts it)."""
    models, stderr = ModelCache(), os.dup(2)
    for line in sys.stdin:
        request = json.loads(line)
        with open(request["log"], "a") as log:
            sys.stderr.flush()
            os.dup2(log.fileno(), 2)
            try:
                job = JobSpec.model_validate_json(Path(request["job"]).read_text())
                rc, clean = run_one(job, Path(request["out"]), models)
            except Exception:
                traceback.print_exc()
                rc, clean = 1, False
            finally:
                sys.stderr.flush()
                os.dup2(stderr, 2)
        emit("exit", rc=rc, last=not clean)
        if not clean:
            return rc or 1
        release()
    return 0


def disk_full(exc: OSError, out: Path) -> str:
    """One line for a full disk: the file it could not write and its folder's free space
    (what was measured before is in utterances.jsonl, written as it was measured)."""
    target = (Path(exc.filename) if exc.filename else out).absolute()
    try:
        free = f"{shutil.disk_usage(target.parent).free / 1e9:.2f} GB free"
    except OSError:
        free = "free space unknown"
    return f"no space left on device writing {target} (folder {target.parent}: {free})"


if __name__ == "__main__":
    sys.exit(main())
