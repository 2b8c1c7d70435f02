"""Where a serving step's device time goes: api.device.kernel_time sums the GPU's activity
(busy time overall and per stream, the top kernels), and serving_bench --profile-gpu records
it over a window of a level's steps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from factories import benchmark

from orchestrate.api.device import device_activity, kernel_time

MS = 1_000_000  # ns


def test_busy_time_is_the_union_and_each_stream_is_summed_apart():
    activity = [
        ("gemm", 7, 0, 4 * MS),  # the decode stream: two kernels back to back
        ("attention", 7, 4 * MS, 6 * MS),
        ("codec_conv", 9, 3 * MS, 8 * MS),  # the codec stream, overlapping both
        ("gemm", 7, 10 * MS, 14 * MS),  # a gap 8..10: nothing ran
    ]
    t = kernel_time(activity)
    assert t["busy_ms"] == pytest.approx(12.0)  # 0..8 and 10..14
    assert t["span_ms"] == pytest.approx(14.0)
    assert t["streams"] == {
        "7": {"ms": pytest.approx(10.0), "busy_ms": pytest.approx(10.0), "events": 3},
        "9": {"ms": pytest.approx(5.0), "busy_ms": pytest.approx(5.0), "events": 1},
    }
    assert [(k["name"], k["calls"], k["ms"], k["streams"]) for k in t["top"]] == [
        ("gemm", 2, pytest.approx(8.0), [7]),
        ("codec_conv", 1, pytest.approx(5.0), [9]),
        ("attention", 1, pytest.approx(2.0), [7]),
    ]


def test_long_names_are_cut_and_merged_and_top_is_bounded():
    activity = [("x" * 300 + "A", 1, 0, MS), ("x" * 300 + "B", 2, MS, 3 * MS), ("y", 1, 0, MS)]
    t = kernel_time(activity, top=1, name_chars=50)
    assert t["top"] == [{"name": "x" * 50, "calls": 2, "ms": pytest.approx(3.0), "streams": [1, 2]}]
    assert kernel_time([]) == {"busy_ms": 0.0, "span_ms": 0.0, "streams": {}, "top": []}


def test_device_activity_refuses_a_machine_without_cuda(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA"), device_activity():
        pass


def _bench():
    return benchmark("serving_bench")


class _Server:
    def __init__(self) -> None:
        self.steps = 0
        self.stats = "the server's own"

    def step(self) -> list[str]:
        self.steps += 1
        return [f"events of step {self.steps}"]

    def live(self) -> int:
        return 10 + self.steps

    def decoding(self) -> tuple[int, int]:
        return 2, 2 * (100 + self.steps)  # two rows, each at position 100 + steps


def _fake_activity(server: _Server):
    """One 0.5 ms kernel on stream 3 for each step taken while the block runs."""

    @contextlib.contextmanager
    def activity() -> Iterator[list[tuple[str, int, int, int]]]:
        out: list[tuple[str, int, int, int]] = []
        first = server.steps
        yield out
        out.extend(("step", 3, i * MS, i * MS + MS // 2) for i in range(first, server.steps))

    return activity


def test_only_the_window_of_steps_is_profiled(monkeypatch: pytest.MonkeyPatch):
    bench, server = _bench(), _Server()
    monkeypatch.setattr(bench, "device_activity", _fake_activity(server))
    window = bench.ProfiledSteps(server, skip=3, steps=4)
    assert [window.step() for _ in range(10)][5] == ["events of step 6"]  # passed through
    assert window.stats == "the server's own"
    assert window.live() == server.live()  # the driver asks the window what it asks a server
    window.close()  # a second close (the level's end) changes nothing
    g = window.summary()
    assert (g["first_step"], g["steps"]) == (3, 4)
    assert g["busy_ms"] == pytest.approx(2.0) and g["busy_ms_per_step"] == pytest.approx(0.5)
    assert g["live_mean"] == pytest.approx((14 + 15 + 16 + 17) / 4)  # after steps 4 to 7
    assert g["decoding_rows_mean"] == 2  # read before each profiled step: steps 3 to 6 done
    assert g["context_mean"] == pytest.approx((103 + 104 + 105 + 106) / 4)
    assert g["streams"]["3"]["events"] == 4 and g["busy_fraction"] > 0


def test_a_window_profile_starts_once_the_sustained_window_opens(monkeypatch):
    """--profile-gpu window:STEPS: a sustained level's profile starts at the first step
    after its window opens (one stream's length in: the load is up), not at a step count
    that may fall in the ramp (the H200 profile at 400 steps saw 106 of 350 streams live)."""
    from orchestrate.running.serving import Load

    bench, server = _bench(), _Server()
    monkeypatch.setattr(bench, "device_activity", _fake_activity(server))
    sustained = Load(rate=50.0, duration_s=16.0, live=320, window_from_s=6.4)
    assert bench.profile_start("window:20", sustained) == (0, 20, 6.4)
    assert bench.profile_start("window:20", Load(concurrency=8)) == (0, 20, 0.0)
    assert bench.profile_start("30:20", sustained) == (30, 20, 0.0)
    ticks = iter(range(1000))  # one second a step
    window = bench.ProfiledSteps(server, 0, 3, after_s=6.4, clock=lambda: float(next(ticks)))
    for _ in range(12):
        window.step()
    g = window.summary()
    assert (g["first_step"], g["steps"], g["after_s"]) == (7, 3, 6.4)  # t = 7 s: the first


class _Event:
    def __init__(self, key: int, frames_ready: int, done: bool) -> None:
        self.key, self.frames_ready, self.done = key, frames_ready, done


class _Streams(_Server):
    """A server of two rows for drive(): each step makes one frame for each live stream."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, int] = {}  # key -> frames made

    def free_rows(self) -> int:
        return 2 - len(self.rows)

    def admit(self, reqs: list[_Event]) -> int:
        n = min(len(reqs), self.free_rows())
        self.rows.update((req.key, 0) for req in reqs[:n])
        return n

    def live(self) -> int:
        return len(self.rows)

    def step(self) -> list[_Event]:
        self.steps += 1
        events = []
        for key in list(self.rows):
            self.rows[key] += 1
            events.append(_Event(key, self.rows[key], self.rows[key] == 3))
            if self.rows[key] == 3:
                del self.rows[key]
        return events


def test_the_driver_serves_through_the_window_as_through_the_server(monkeypatch):
    """drive() runs a level on the profiling window exactly as on the server itself: every
    stream complete, the same frames, and the window's steps profiled."""
    from orchestrate.running.serving import drive

    bench = _bench()
    requests = [_Event(key, 0, False) for key in range(4)]  # drive reads a request's .key
    plain = drive(_Streams(), requests, [0.0] * 4, [3] * 4, 10.0)[0]
    server = _Streams()
    monkeypatch.setattr(bench, "device_activity", _fake_activity(server))
    window = bench.ProfiledSteps(server, skip=1, steps=2)
    records = drive(window, requests, [0.0] * 4, [3] * 4, 10.0)[0]
    window.close()
    assert all(r.done and len(r.frame_ready_s) == 3 for r in records)
    assert [len(r.frame_ready_s) for r in records] == [len(r.frame_ready_s) for r in plain]
    assert window.summary()["steps"] == 2 and server.steps == 6


def test_a_level_shorter_than_the_skip_says_nothing_was_profiled(monkeypatch):
    bench, server = _bench(), _Server()
    monkeypatch.setattr(bench, "device_activity", _fake_activity(server))
    window = bench.ProfiledSteps(server, skip=50, steps=10)
    for _ in range(20):
        window.step()
    window.close()
    assert window.summary() == {
        "first_step": 50,
        "steps": 0,
        "note": "the level made 20 steps: none profiled",
    }


@pytest.mark.parametrize(
    "value, message",
    [
        ("ten", "SKIP:STEPS, two integers"),
        ("5", "SKIP:STEPS, two integers"),
        ("5:0", "SKIP >= 0 and STEPS >= 1"),
        ("-1:5", "SKIP >= 0 and STEPS >= 1"),
        ("windows:5", "two integers \\(or window:STEPS\\)"),
        ("window:0", "SKIP >= 0 and STEPS >= 1"),
    ],
)
def test_a_malformed_window_is_refused(value: str, message: str):
    bench = _bench()
    args = bench.parse(["--device", "cuda", f"--profile-gpu={value}"])
    with pytest.raises(bench.LoadError, match=message):
        bench.plan(args)


def test_one_profiler_a_run():
    bench = _bench()
    args = bench.parse(["--device", "cuda", "--profile-gpu", "1:2", "--profile-host"])
    with pytest.raises(bench.LoadError, match="one profiler a run"):
        bench.plan(args)


@pytest.mark.gpu
def test_kernels_on_two_streams_are_recorded_apart():
    x = torch.randn(2048, 2048, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # x is written on the default stream
    with device_activity() as activity:
        y = x @ x
        with torch.cuda.stream(side):
            z = x @ x
    torch.cuda.synchronize()
    assert torch.equal(y, z)
    t = kernel_time(activity)
    assert len(t["streams"]) == 2 and t["busy_ms"] > 0
    assert t["busy_ms"] <= sum(s["ms"] for s in t["streams"].values()) + 1e-9


class _Cleared:
    def __init__(self) -> None:
        self.cleared = 0

    def clear(self) -> None:
        self.cleared += 1


def test_the_profile_comes_from_a_second_run_and_the_figures_from_the_first(monkeypatch):
    """--profile-gpu never perturbs a reported figure: the level is run unprofiled, then
    again for its profile alone; a failing profiled run leaves the measured level whole."""
    import argparse
    import time

    bench = _bench()
    calls: list[tuple[int, int] | None] = []

    def run(server, load, prompt, frames, args, limit_s, path, gpu_window=None):
        calls.append(gpu_window)
        if gpu_window is None:
            return {"path": path, "served": 7}
        if fail:
            raise RuntimeError("CUPTI unavailable")
        return {"path": path, "served": 1, "gpu_profile": {"steps": gpu_window[1]}}

    monkeypatch.setattr(bench, "run_ours", run)
    args = argparse.Namespace(profile_gpu="10:20")
    deadline = time.perf_counter() + 60
    fail = False
    level = bench.measured_level(_Cleared(), None, [], 1, args, deadline, "ours")
    assert calls == [None, (10, 20, 0.0)]
    assert level == {"path": "ours", "served": 7, "gpu_profile": {"steps": 20}}
    fail, server = True, _Cleared()
    level = bench.measured_level(server, None, [], 1, args, deadline, "ours")
    assert level == {
        "path": "ours",
        "served": 7,
        "gpu_profile": {"error": "RuntimeError: CUPTI unavailable"},
    }
    assert server.cleared == 1  # the failed run's streams are gone before the next level
    calls.clear()
    bench.measured_level(
        _Cleared(), None, [], 1, argparse.Namespace(profile_gpu=None), deadline, "o"
    )
    assert calls == [None]  # without the flag: one run
