"""Record factories shared by the tests: fabricated results, stacks and utterances, and the
CLI run as a user runs it (`run_cli`).

One place, so a change to the record schema is made once. `fabricate_result` is a realistic
finished run with awkward floats (round trips must be exact); `utterances`, `stack_result`
and `result_record` build timed results whose speedups a test chooses. `benchmark` loads a
script of benchmarks/ as a module (they are scripts, not a package).
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
import wave
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType

from orchestrate.api.config import ModelSpec, Prompt, StackSpec, TechniqueRef, Workload
from orchestrate.api.records import (
    EnvironmentInfo,
    FidelityRecord,
    JobSpec,
    ResultRecord,
    StackResult,
    UtteranceRecord,
)

MakeResult = Callable[..., ResultRecord]
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark(script: str) -> ModuleType:
    """benchmarks/<script>.py loaded as a fresh module (its globals its own: a test may
    monkeypatch them)."""
    spec = importlib.util.spec_from_file_location(f"bench_{script}", BENCHMARKS / f"{script}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_cli(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """`python -m orchestrate.cli ARGS` in a subprocess (its own exit code, stdout and
    stderr, as a user sees them), with `env` and `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def submit_seeded(workload: Workload, seeds: range, env: dict[str, str], cwd: Path) -> list[str]:
    """`orchestrate submit` one cpu-fast job per seed of `workload` (a job each, so a pool
    has several to share); their job ids, in order."""
    import json

    path, ids = cwd / "wl.yaml", []
    for seed in seeds:
        path.write_text(json.dumps(workload.model_copy(update={"seeds": [seed]}).model_dump()))
        out = run_cli(["submit", "--stack", "cpu-fast", "--workload", str(path),
                       "--fidelity-steps", "0", "--json"], env, cwd)  # fmt: skip
        assert out.returncode == 0, out.stderr
        ids.append(json.loads(out.stdout)["job_id"])
    return ids


def _write_wav(path: Path, frames: int = 240) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(bytes(2 * frames))


def fabricate_result(
    job_id: str | None = None,
    audio_dir: Path | None = None,
    status: str = "finished",
    code_sha: str | None = "0123abcd4567ef",
) -> ResultRecord:
    """A realistic finished result: stock baseline + one approximate stack, 3 utterances each.

    Float values are deliberately awkward (many digits, None where optional) so round trips
    through storage must be exact. With `audio_dir`, the WAVs the record names are written.
    """
    workload = Workload(
        name="smoke",
        prompts=[Prompt(id=f"p{i}", text=f"Prompt number {i}.") for i in range(3)],
        seeds=[42],
        save_audio=2,
    )
    stock = StackSpec(name="stock", description="no techniques")
    fast = StackSpec(
        name="fast",
        techniques=[
            TechniqueRef(name="static_kv_cache", params={"max_len": 512, "graphs": True}),
            TechniqueRef(name="codebook_head", params={"top_k": 8}),
        ],
    )
    job = JobSpec(
        model=ModelSpec(preset="tiny", dtype="float32", device="cpu"),
        workload=workload,
        stacks=[stock, fast],
        output_dir="out",
        code_sha=code_sha,
        **({"job_id": job_id} if job_id else {}),
    )
    t0 = datetime(2025, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)

    def utterances(stack: str, scale: float) -> list[UtteranceRecord]:
        out = []
        for i, prompt in enumerate(workload.prompts):
            rel = f"{stack}/{prompt.id}_42.wav"
            if audio_dir is not None:
                _write_wav(audio_dir / rel)
            out.append(
                UtteranceRecord(
                    prompt_id=prompt.id,
                    seed=42,
                    round=i,
                    latency_s=scale * (0.312345678901 + i / 7),
                    lm_s=scale * (0.25 + i / 9),
                    codec_s=0.0412345 + i / 1000,
                    prefill_s=None if i == 2 else 0.01 * (i + 1),
                    time_to_first_audio_s=0.05 + i / 100 if stack == "fast" else None,
                    prompt_tokens=17 + i,
                    new_tokens=640,
                    frames=80,
                    audio_s=6.4,
                    stop_reason="length_policy",
                    audio_path=rel,
                    finite=True,
                    peak_abs=0.5 + i / 3,
                    clipped_samples=i,
                )
            )
        return out

    results = [
        StackResult(
            stack=stock,
            status="ok",
            setup_s=1.25,
            warmup_s=0.75,
            peak_memory_bytes=3 * 2**30 + 7,
            utterances=utterances("stock", 1.0),
            metrics={"rtf": 0.0812345678901, "median_latency_s": 0.455, "tokens_per_s": 1400.5},
        ),
        StackResult(
            stack=fast,
            status="ok",
            applied=["static_kv_cache@1", "codebook_head@2"],
            skipped={"audio_head": "needs CUDA"},
            exact=False,
            setup_s=4.5,
            warmup_s=2.0,
            peak_memory_bytes=None,
            utterances=utterances("fast", 0.5),
            fidelity=FidelityRecord(
                steps=32,
                max_abs_logit_diff=0.0123,
                mean_kl=1.5e-5,
                max_kl=3.25e-4,
                top1_agreement=0.96875,
                topk_agreement=0.9,
                within_tolerance=True,
                tolerance=0.05,
            ),
            metrics={"rtf": 0.0406172839, "median_latency_s": 0.2275, "tokens_per_s": 2801.0},
        ),
    ]
    environment = EnvironmentInfo(
        hostname="gpu-host-1",
        platform="Linux-6.8-x86_64",
        python="3.11.9",
        torch="2.9.0",
        transformers="5.0.0",
        cuda="12.8",
        device_name="NVIDIA H200",
        driver="570.86",
        sm_clock_mhz=1980.0,
        gpu_count=1,
        cpu_count=16,
        git_sha=code_sha,
        git_dirty=False,
        model_config_hash="cafe1234",
        packages={"torch": "2.9.0", "numpy": "2.1.0"},
    )
    return ResultRecord(
        job=job,
        status=status,
        started_at=t0,
        finished_at=t0 + timedelta(seconds=93, microseconds=654321),
        environment=environment,
        results=results,
    )


def utterances(
    scale: float, n: int = 8, jitter: float = 0.0, seed: int = 0, prompts: int = 4
) -> list[UtteranceRecord]:
    """n timed utterances: latency = scale x a per-prompt base time x (1 +- jitter)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = i % prompts
        latency = scale * (0.4 + 0.1 * p) * (1 + rng.uniform(-jitter, jitter))
        out.append(
            UtteranceRecord(
                prompt_id=f"p{p}", seed=42 + i // prompts, round=i, latency_s=latency,
                lm_s=0.8 * latency, codec_s=0.2 * latency, prompt_tokens=20, new_tokens=640,
                frames=80, audio_s=6.4, stop_reason="length_policy",
            )
        )  # fmt: skip
    return out


def stack_result(spec: StackSpec, scale: float, **kw: object) -> StackResult:
    from orchestrate.running.metrics import summarize

    utts = utterances(scale, **kw)  # type: ignore[arg-type]
    return StackResult(stack=spec, status="ok", utterances=utts, metrics=summarize(utts))


def result_record(results: list[StackResult], when: datetime | None = None) -> ResultRecord:
    t0 = when or datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    workload = Workload(
        name="smoke", prompts=[Prompt(id=f"p{i}", text=f"Prompt {i}.") for i in range(4)],
        seeds=[42, 43],
    )  # fmt: skip
    job = JobSpec(
        model=ModelSpec(preset="tiny"),
        workload=workload,
        stacks=[r.stack for r in results],
        output_dir="out",
    )
    env = EnvironmentInfo(
        hostname="h", platform="Linux", python="3.11", torch="2.9", transformers="5.0",
        device_name="Test CPU", cpu_count=2, model_config_hash="abc",
    )  # fmt: skip
    return ResultRecord(
        job=job, status="finished", started_at=t0, finished_at=t0 + timedelta(seconds=9),
        environment=env, results=results,
    )  # fmt: skip


def int8_dot_products() -> bool:
    """Whether this x86 CPU multiplies int8 with VNNI (or AMX). Without it onnxruntime's
    static INT8 was 0.92x-1.15x stock on a 2-core AMD EPYC (paired; the 95% CI reached
    below 1 in three of the six jobs measured), so no approximate Piper stack clears a speed
    bar there and the gate is never reached; elsewhere (not x86, no /proc) the test runs."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return True
    if "avx2" not in flags:
        return True
    return any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))
