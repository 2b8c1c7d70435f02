"""What a number was measured on: host, device, driver, clocks, versions, code SHA."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import re
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from orchestrate.api.config import REPO_ROOT
from orchestrate.api.device import sync
from orchestrate.api.records import EnvironmentInfo


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty). ORCHESTRATE_CODE_SHA wins when set: a copied tree (a GPU host's
    snapshot) may sit inside another checkout whose HEAD is not the code that runs."""
    state = code_state(with_diff=False)
    return state.sha, state.dirty


@dataclass(frozen=True)
class CodeState:
    """The code a job runs: the commit, and what differs from it in this tree."""

    sha: str | None
    dirty: bool | None  # tracked changes or untracked, not-ignored files; None: unknown
    diff_hash: str | None  # hash of those changes; None: clean or unknown


def code_state(with_diff: bool = True) -> CodeState:
    """The commit plus, with `with_diff`, a hash of `git diff HEAD` (tracked files) and of
    the names and contents of untracked files git does not ignore: an uncommitted edit to a
    technique is a different experiment from the commit's code."""
    if sha := os.environ.get("ORCHESTRATE_CODE_SHA"):
        # A copied tree has no .git of its own (or sits in an unrelated checkout), so what
        # differs from that commit cannot be read: dirty and the diff hash are unknown (None)
        # and the identity rests on the SHA and the techniques' source hashes. The full SHA
        # only: a short one is ambiguous in the records and differs from what a resume or
        # another host presents for the same commit.
        if not re.fullmatch(r"[0-9a-f]{40}", sha):
            raise ValueError(
                f"ORCHESTRATE_CODE_SHA must be a full 40-character commit SHA "
                f"(git rev-parse HEAD), got {sha!r}"
            )
        return CodeState(sha, None, None)
    try:
        sha = _git("rev-parse", "HEAD").decode().strip()
        if not with_diff:
            changed = _git("status", "--porcelain", "--untracked-files=no")
            return CodeState(sha, bool(changed.strip()), None)
        # `-- .`: this project's tree only, as ls-files below sees it from REPO_ROOT.
        diff = _git("diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", "--", ".")
        untracked = sorted(
            filter(None, _git("ls-files", "-z", "--others", "--exclude-standard").split(b"\0"))
        )
    except (OSError, subprocess.SubprocessError):
        return CodeState(None, None, None)
    if not (diff or untracked):
        return CodeState(sha, False, None)
    digest = hashlib.sha256(diff)
    for name in untracked:
        digest.update(b"\0" + name + b"\0")
        try:
            digest.update((REPO_ROOT / os.fsdecode(name)).read_bytes())
        except OSError:  # a nested checkout or unreadable file: its name still counts
            digest.update(b"<unreadable>")
    return CodeState(sha, True, digest.hexdigest()[:16])


def _git(*args: str) -> bytes:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, timeout=30, check=True
    ).stdout


def _nvidia_smi() -> dict[str, float | str]:
    fields = "driver_version,clocks.sm,clocks.mem,power.draw"
    try:
        line = (
            subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    out: dict[str, float | str] = {}
    for key, raw in zip(("driver", "sm", "mem", "power"), line.split(","), strict=False):
        raw = raw.strip()
        try:
            out[key] = raw if key == "driver" else float(raw)
        except ValueError:
            continue  # "[N/A]" on some boards
    return out


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _median_seconds(fn: Callable[[], object], dev: torch.device, repeats: int) -> float:
    """Median wall time of `fn` over `repeats` runs after one warm-up run (allocator,
    caches, library handles), each bracketed by a device sync."""
    times = []
    for _ in range(repeats + 1):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _device(device: str) -> torch.device:
    return torch.device(device if device != "cuda" or torch.cuda.is_available() else "cpu")


def copy_bandwidth_gb_s(device: str, repeats: int = 5) -> float:
    """Median bandwidth of a large device-local copy, counting bytes read plus written.

    Sized far past the caches (1 GiB on a GPU, 256 MiB in host memory).
    """
    dev = _device(device)
    nbytes = (1 << 30) if dev.type == "cuda" else (1 << 28)
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=dev).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), dev, repeats) / 1e9


def read_bandwidth_gb_s(device: str, repeats: int = 5) -> float:
    """Median rate of reading a large device-local tensor once (an amax over 2 GiB on a GPU,
    256 MiB in host memory; one value written): the ceiling of a step that streams its
    weights and cache. Not in the environment record (benchmarks/batched_step.py reads it)."""
    dev = _device(device)
    nbytes = (1 << 31) if dev.type == "cuda" else (1 << 28)
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
    return nbytes / _median_seconds(src.amax, dev, repeats) / 1e9


def matmul_tflop_s(device: str, dtype: torch.dtype, repeats: int = 3) -> float:
    """Median throughput of a square matmul (8192 on a GPU, 1024 on a CPU): the compute
    ceiling a per-step floor is measured against, on random data as models see it."""
    dev = _device(device)
    n = 8192 if dev.type == "cuda" else 1024
    dtype = dtype if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n**3 / _median_seconds(lambda: a @ b, dev, repeats) / 1e12


def fp8_matmul_tflop_s(device: str = "cuda", repeats: int = 3) -> float:
    """Median throughput of an 8192^3 e4m3 matmul (torch._scaled_mm, bf16 out; Hopper and
    later): the compute ceiling of FP8 projections. Not in the environment record
    (benchmarks/batched_step.py reads it)."""
    dev = _device(device)
    n = 8192
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()  # column-major operand
    one = torch.ones((), device=dev)

    def run() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return 2 * n**3 / _median_seconds(run, dev, repeats) / 1e12


def _cpuinfo(key: str) -> list[str]:
    """Values of `key` lines in /proc/cpuinfo, one per logical core that has it."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return []
    return [v.strip() for k, _, v in (ln.partition(":") for ln in text.splitlines())
            if k.strip() == key]  # fmt: skip


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return {}
    return {
        k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.stdout.splitlines())
    }


def cpu_model() -> str | None:
    names = _cpuinfo("model name") or [_lscpu().get("Model name", "")]
    return names[0] or platform.processor() or None


def cpu_max_mhz() -> float | None:
    """The max clock where the kernel says it (cpufreq, lscpu); else the highest clock
    /proc/cpuinfo reports, which is what a VM (no cpufreq) shows as its nominal clock."""
    try:
        khz = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()
        return float(khz) / 1e3
    except (OSError, ValueError):
        pass
    lscpu = _lscpu().get("CPU max MHz")
    clocks = []
    for raw in [lscpu] if lscpu else _cpuinfo("cpu MHz"):
        with contextlib.suppress(ValueError):
            clocks.append(float(raw))
    return max(clocks, default=None)


@functools.cache
def single_thread_ms(repeats: int = 5) -> float:
    """Median ms of a fixed pure-Python loop, once per worker: the host's single-thread speed,
    which bounds a token loop's launches and syncs. Comparable across hosts on one Python."""

    def loop() -> int:
        total = 0
        for i in range(300_000):
            total += i * i % 7
        return total

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loop()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def capture(
    device: str, model_config_hash: str, dtype: torch.dtype | None = None
) -> EnvironmentInfo:
    """Read once per job, after warm-up, so the clocks are the ones the timing ran at."""
    cuda = device == "cuda" and torch.cuda.is_available()
    smi = _nvidia_smi() if cuda else {}
    sha, dirty = git_state()
    pkgs = {p: v for p in ("triton", "numpy", "pydantic", "cuda-bindings") if (v := _version(p))}
    return EnvironmentInfo(
        hostname=socket.gethostname(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=_version("transformers") or "?",
        cuda=torch.version.cuda if cuda else None,
        device_name=torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
        driver=str(smi["driver"]) if "driver" in smi else None,
        sm_clock_mhz=smi.get("sm"),  # type: ignore[arg-type]
        mem_clock_mhz=smi.get("mem"),  # type: ignore[arg-type]
        power_w=smi.get("power"),  # type: ignore[arg-type]
        gpu_count=torch.cuda.device_count() if cuda else 0,
        copy_gb_s=copy_bandwidth_gb_s(device),
        matmul_tflop_s=matmul_tflop_s(device, dtype) if dtype is not None else None,
        cpu_count=os.cpu_count() or 1,
        cpu_model=cpu_model(),
        cpu_max_mhz=cpu_max_mhz(),
        cpu_single_thread_ms=single_thread_ms(),
        git_sha=sha,
        git_dirty=dirty,
        model_config_hash=model_config_hash,
        packages=pkgs,
    )


def hardware_key(env: EnvironmentInfo) -> str:
    """What a measurement is comparable by: the device (and GPU count) it ran on. A pool
    worker sees one GPU (CUDA_VISIBLE_DEVICES), so its key equals a one-GPU host's."""
    return env.device_name + (f" x{env.gpu_count}" if env.gpu_count > 1 else "")


def local_hardware(device: str) -> str:
    """This host's hardware key, computed as capture() names the device."""
    if device == "cuda" and torch.cuda.is_available():
        n = torch.cuda.device_count()
        return torch.cuda.get_device_name() + (f" x{n}" if n > 1 else "")
    return platform.processor() or "cpu"
