"""api.device.sync_sites: host-device synchronisations counted by the source line that made
them (serving_bench --sync-sites: where a pipelined server's host waits for the GPU)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from orchestrate.api.device import sync_sites

HERE = Path(__file__).parent


def _flagged() -> None:
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


def test_sites_are_the_innermost_frames_under_root_and_other_warnings_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's sync warning (faked here, as on a CPU torch raises none) is counted at the
    innermost frames under `root`; any other warning is shown as before, not swallowed."""
    modes: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with pytest.warns(DeprecationWarning, match="unrelated"), sync_sites(HERE) as counts:
        for _ in range(3):
            _flagged()
        warnings.warn("unrelated", DeprecationWarning, stacklevel=1)
    (site,) = counts
    inner, outer = site.split(" < ")
    assert inner.startswith("test_sync_sites.py:") and inner.endswith(" _flagged")
    assert outer.endswith(" test_sites_are_the_innermost_frames_under_root_and_other_warnings_pass")
    assert counts[site] == 3
    assert modes == ["warn", 0]  # the debug mode is put back


def test_a_sync_outside_root_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    with sync_sites(HERE / "no-such-folder") as counts:
        _flagged()
    assert list(counts) == [f"(outside {(HERE / 'no-such-folder').resolve()})"]


@pytest.mark.gpu
def test_a_blocking_read_is_counted_at_its_line_and_device_work_is_not() -> None:
    x = torch.ones(1024, device="cuda")
    with sync_sites(HERE) as counts:
        y = (x * 2).cumsum(0)  # queued on the device: no sync
        total = y[-1].item()  # the one sync
    assert total == 2048.0
    (site,) = counts
    assert site.startswith("test_sync_sites.py:") and counts[site] == 1
    assert "test_a_blocking_read_is_counted" in site
