"""The repository speaks of itself correctly (issue 35): every file path and every
`orchestrate.*` module that a tracked text file names exists, so a docstring or comment left
pointing at a moved or deleted file fails CI instead of sending a reader to nothing; and it
speaks of the product, not of the work periods it was made in (no development diary)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORCHESTRATOR = ROOT / "orchestrator"  # the core's rooms: `running/guards.py` means this folder's

# What is read: source, scripts, configs and docs. Committed records (.json, .log, ...) are
# data, quoted as measured; they are not checked.
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".ini", ".j2", ".mako"}
TEXT_NAMES = {".ci/run", ".importlinter"}
THIS_FILE = "tests/test_repository.py"  # it names the allow-list's missing paths itself

# A path: folders and a file name with a suffix (a glob star allowed), not glued to a word,
# a URL, a variable ($OUT/x) or another path before it.
PATH = re.compile(r"(?<![\w/.$~-])((?:[\w.*-]+/)+[\w*-][\w.*-]*\.[A-Za-z][\w]*)(?![\w/-])")
# A module of this package: `orchestrate.running.guards` (an attribute may follow).
MODULE = re.compile(r"(?<![\w./-])(orchestrate(?:\.\w+)+)(?![\w-])")
# Names that stand for any value (`experiments/NAME.yaml`, `protocols/NAME-vN.yaml`).
PLACEHOLDER = re.compile(r"NAME|\bID\b|<|\{")
# What ends a file's name; any other "suffix" is an attribute: `running/guards.mark` names
# the function `mark` of running/guards.py.
FILE_SUFFIXES = {
    "py", "sh", "md", "yaml", "yml", "toml", "ini", "j2", "mako", "txt", "json", "jsonl",
    "log", "db", "tgz", "gz", "png", "wav", "html", "csv", "lock", "whl",
}  # fmt: skip

# Paths named on purpose though not in the tree, each with why. Keep this short: a path that
# moved is fixed where it is named, not listed here.
ALLOWED_MISSING = {
    # written by `orchestrate noise` (README's protocol walkthrough): an output, not a source
    "configs/protocols/default-v2.yaml",
    # a user's hypothetical holdout file in research/holdout.py's docstring
    "configs/holdout/x.yaml",
    # written by benchmarks/ov_gemm_sweep.py --stack-out (kernel_sweeps.sh ov-gemm) where a
    # config beats cuBLAS, then read by the ov-gemm modes of benchmarks/ab.sh and profiles.sh
    "benchmarks/stacks/ov-best-packed-gemm.yaml",
    # removed with its negative result; the ov-inductor-pdl modes of benchmarks/ab.sh and
    # profiles.sh say to run them from a checkout of 25cd9e0, where it exists
    "benchmarks/stacks/ov-best-packed-qkv-pdl.yaml",
}


# A development diary: text that counts the work periods the repository was made in
# ("session 7", "sessions 3-18"), and file names tagged with one (`speed2_s7.sh`,
# `issue14-s12-preload.json`, `exp74-full-s6.yaml`). A record or a script is named by what
# it measures; a result is quoted with its commit and date. Records are read for their names
# only: what a stack's description said when it was measured stays as measured.
DIARY_TEXT = re.compile(r"(?i)\bsessions?\s+[0-9]+")
DIARY_NAME = re.compile(r"_s[0-9]+\.|-s[0-9]+[-./]")


def tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        pytest.skip("not a git checkout: no tracked files to read")
    return [n for n in out.stdout.split("\0") if n]


def tracked_text_files() -> list[str]:
    return [
        n
        for n in tracked_files()
        if (Path(n).suffix in TEXT_SUFFIXES or n in TEXT_NAMES)
        and n != THIS_FILE
        and (ROOT / n).is_file()  # tracked but deleted in this working tree: not read
    ]


def resolves(path: str, mentioned_in: Path) -> bool | None:
    """Whether `path` exists where its first folder lives: the repository root, the mentioning
    file's folder (a record beside benchmarks/README.md), or orchestrator/ (a room). None when
    no such folder exists: `OUT/x.log`, `path/to/file.py` are not this repository's paths."""
    first = path.split("/", 1)[0]
    if first in {".", ".."}:  # relative to where a command runs (./orchestrate.db): no file
        return None
    stem, _, suffix = path.rpartition(".")
    if suffix not in FILE_SUFFIXES:
        path = f"{stem}.py"
    bases = [b for b in (ROOT, mentioned_in.parent, ORCHESTRATOR) if (b / first).is_dir()]
    if not bases:
        return None
    if "*" in path:
        return any(any(b.glob(path)) for b in bases)
    return any((b / path).exists() for b in bases)


def package_dirs() -> dict[str, Path]:
    """pyproject's package-dir: `orchestrate.families` -> families/, ..."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def module_exists(dotted: str, dirs: dict[str, Path]) -> bool:
    """Whether `orchestrate.a.b[.attr...]` names a package or module of this checkout: the
    longest package-dir prefix, then folders down to a module file; what follows a module is
    an attribute (not checked), and a name a package's __init__.py defines counts too."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in dirs:
            folder, rest = dirs[".".join(parts[:k])], parts[k:]
            break
    else:
        return False
    for part in rest:
        if (folder / part).is_dir():
            folder = folder / part
        elif (folder / f"{part}.py").is_file():
            return True
        else:
            init = folder / "__init__.py"
            return init.is_file() and re.search(rf"\b{part}\b", init.read_text("utf-8")) is not None
    return folder.is_dir()


def test_every_named_path_and_module_exists() -> None:
    dirs = package_dirs()
    stale: list[str] = []
    allowed_seen: set[str] = set()
    for name in tracked_text_files():
        file = ROOT / name
        for number, line in enumerate(file.read_text("utf-8", errors="replace").splitlines(), 1):
            for match in PATH.finditer(line):
                path = match.group(1).rstrip(".")
                if path in ALLOWED_MISSING:
                    allowed_seen.add(path)
                elif not PLACEHOLDER.search(path) and resolves(path, file) is False:
                    stale.append(f"{name}:{number}: {path}")
            for match in MODULE.finditer(line):
                if not module_exists(match.group(1), dirs):
                    stale.append(f"{name}:{number}: {match.group(1)}")
    assert not stale, "named but not in the tree (fix the mention):\n" + "\n".join(stale)
    # The allow-list stays honest: each entry is still named somewhere and still absent.
    assert allowed_seen == ALLOWED_MISSING, f"named nowhere now: {ALLOWED_MISSING - allowed_seen}"
    present = sorted(p for p in ALLOWED_MISSING if (ROOT / p).exists())
    assert not present, f"in the tree now, so not hypothetical: {present}"


def test_the_check_catches_a_moved_module() -> None:
    """The scan itself: the old flat paths are caught, their rooms' paths pass."""
    here = ROOT / "README.md"
    assert resolves("orchestrator/" + "gate.py", here) is False
    assert resolves("orchestrator/research/gate.py", here) is True
    assert resolves("running/guards.py", here) is True  # a room, named from orchestrator/
    assert resolves("running/guards.mark", here) is True  # a module's attribute
    assert resolves("running/" + "guard.mark", here) is False
    assert resolves("h200/issue14-ladder.result.json", ROOT / "benchmarks" / "README.md") is True
    assert resolves("OUT/gpu-tests.log", here) is None  # not a folder of this repository
    dirs = package_dirs()
    assert not module_exists("orchestrate." + "launches", dirs)
    assert module_exists("orchestrate.api.device.count_launches", dirs)
    assert module_exists("orchestrate.families.rumik", dirs)


def test_no_development_diary() -> None:
    """No tracked text counts work periods and no tracked file is named for one (issue 35)."""
    found = []
    for name in tracked_text_files():
        text = (ROOT / name).read_text("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if DIARY_TEXT.search(line):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    found += [f"{n}: named for a work period" for n in tracked_files() if DIARY_NAME.search(n)]
    assert not found, (
        "a development diary (say what is measured and why; name records by what they "
        "measure, quote results with their commit):\n" + "\n".join(found)
    )


def test_the_diary_check_catches_work_periods() -> None:
    """The patterns themselves: work periods are caught, ordinary text and names are not."""
    diary = ["## Session 7 (2026-12-02)", "as session 14 profiled it", "(sessions 3-18)"]
    assert all(DIARY_TEXT.search(t) for t in diary)
    plain = ["the onnxruntime session's options", "one session per transaction", "fp16, 30 s, s8"]
    assert not any(DIARY_TEXT.search(t) for t in plain)
    tagged = [
        "benchmarks/speed2_s7.sh",
        "benchmarks/h200/issue14-s12-preload.result.json",
        "experiments/exp74-full-s6.yaml",
        "benchmarks/h200/issue13-explore-exp74-s8-events/aa4f0d2d648a.jsonl",
    ]
    assert all(DIARY_NAME.search(n) for n in tagged)
    named = [
        "benchmarks/h200/issue14-gemv-sweep-pdl.json",
        "benchmarks/cpu/frames-sweep-32.result.json",
        "benchmarks/stacks/ov-best-packed-qkv-v3.yaml",
        "tests/test_kernels.py",
    ]
    assert not any(DIARY_NAME.search(n) for n in named)
