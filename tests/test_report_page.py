"""The exploration report page: self-contained, and its audio players load in a browser."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from orchestrate.reports.exploration_page import (
    Clip,
    ExplorationView,
    Node,
    render,
    save_figures,
)


def wav_base64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode("ascii")


def _wav(path: Path, freq: float) -> Path:
    t = np.arange(16_000) / 16_000
    sf.write(path, 0.3 * np.sin(2 * np.pi * freq * t), 16_000)
    return path


def _view(tmp_path: Path, clips: list[Clip]) -> ExplorationView:
    nodes = [
        Node(1, None, "+static_kv_cache", "ladder", "accept", "CI clears the bar", 1.4, 1.3, 1.5),
        Node(2, 1, "+audio_head", "ladder", "drop", "below the noise bar", 1.41, 1.35, 1.47),
        Node(3, 1, "+packed_projections", "ladder", "accept", "CI clears the bar", 1.6, 1.5, 1.7),
        Node(4, 3, "-static_kv_cache", "ablation", "error", "needs 'static_kv_cache'"),
    ]
    return ExplorationView(
        id="abc123def4567890",
        family="rumik",
        model="tiny",
        device="cpu",
        workload="smoke",
        root="stock",
        baseline="stock",
        status="FINISHED",
        stop_reason="patience: 3 proposals without a gain",
        champion="explore-3",
        champion_headline=1.6,
        champion_lo=1.5,
        champion_hi=1.7,
        headline_label="speedup (paired, 95% CI)",
        nodes=nodes,
        ladder=[("+static_kv_cache", 1.4), ("+packed_projections", 1.6)],
        listening=clips,
    )


def test_page_holds_tree_ledger_figures_and_players(tmp_path: Path) -> None:
    clip = Clip(
        "en01 · seed 42",
        wav_base64(_wav(tmp_path / "a.wav", 220)),
        wav_base64(_wav(tmp_path / "b.wav", 330)),
    )
    page = render(_view(tmp_path, [clip]), tmp_path / "page.html").read_text()
    assert page.count("<audio") == 2
    assert page.count('src="data:image/png;base64,') == 2  # frontier and ladder, embedded
    assert 'src="http' not in page and 'href="http' not in page  # self-contained
    # the tree nests the second accept under the first, and the ablation under that
    tree = page[page.index("Tree of tried stacks") : page.index("<h2>Ledger")]
    assert tree.index("+static_kv_cache") < tree.index("+packed_projections")
    assert tree.index("+packed_projections") < tree.index("-static_kv_cache")
    assert re.search(r"drop</span> <code>\+audio_head</code>", tree)
    assert "1.60x [1.50, 1.70]" in page  # the champion's headline with its CI


def test_the_page_figures_can_be_saved_as_png_files(tmp_path: Path) -> None:
    view = _view(tmp_path, [])
    render(view, tmp_path / "page.html")
    saved = save_figures(view, tmp_path / "figs", "e1")
    assert [p.name for p in saved] == ["e1-frontier.png", "e1-ladder.png"]
    for path in saved:  # the same pictures the page embeds, as real PNG files
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "page.html").read_text()
    assert all(png in page for png in (view.frontier_png, view.ladder_png))


def test_frontier_labels_keep_the_step_and_drop_what_came_along() -> None:
    from orchestrate.reports.exploration_page import _short

    assert _short(3, "+graph_loop (with static_kv_cache, device_sampler)") == "#3 +graph_loop"
    params = "+num_step(value=23), +t_shift(value=0.7127)"
    assert _short(11, params) == "#11 +num_step, +t_shift"
    assert _short(4, "-graph_loop+while_graph") == "#4 -graph_loop+while_graph"


def test_page_without_audio_says_so(tmp_path: Path) -> None:
    page = render(_view(tmp_path, []), tmp_path / "page.html").read_text()
    assert "<audio" not in page
    assert "No saved audio" in page


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium_dom(page: Path, screenshot: Path | None = None) -> str:
    """The page's DOM after it ran in headless Chromium (and its screenshot, if asked)."""
    browser = _chromium()
    if browser is None:
        if os.environ.get("ORCHESTRATE_REQUIRE_QUALITY") == "1":
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed")
    flags = [
        browser,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--virtual-time-budget=5000",
    ]
    if screenshot is not None:
        shot = [*flags, "--window-size=1280,2000", f"--screenshot={screenshot}"]
        subprocess.run(
            [*shot, page.resolve().as_uri()], capture_output=True, timeout=120, check=True
        )
    out = subprocess.run(
        [*flags, "--dump-dom", page.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout


def _loaded(page: Path) -> tuple[int, int]:
    """(players, players whose audio decoded) after the page ran in headless Chromium."""
    out = _chromium_dom(page)
    body = re.search(r'<body data-players="(\d+)" data-loaded="(\d+)"', out)
    assert body, f"the page's script did not run: {out[:300]!r}"
    return int(body.group(1)), int(body.group(2))


def test_players_load_in_headless_chromium(tmp_path: Path) -> None:
    clips = [
        Clip(
            f"en0{i} · seed 42",
            wav_base64(_wav(tmp_path / f"a{i}.wav", 200 + i)),
            wav_base64(_wav(tmp_path / f"b{i}.wav", 300 + i)),
        )
        for i in (1, 2)
    ]
    page = render(_view(tmp_path, clips), tmp_path / "page.html")
    assert _loaded(page) == (4, 4)


def test_the_browser_check_sees_a_broken_player(tmp_path: Path) -> None:
    good = wav_base64(_wav(tmp_path / "a.wav", 220))
    broken = Clip("en01 · seed 42", good, "AAAA" + good[4:])  # not a RIFF header any more
    page = render(_view(tmp_path, [broken]), tmp_path / "page.html")
    assert _loaded(page) == (2, 1)
