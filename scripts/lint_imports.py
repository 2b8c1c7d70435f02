"""Check the import contracts in `.importlinter` over the whole `orchestrate` namespace.

The namespace maps several top-level folders (orchestrator/, families/, techniques/, ...)
into one import package (pyproject's package-dir). import-linter's graph builder walks only
the root package's own folder, so this script lays the namespace out as one tree of copies
in a temporary folder, puts it first on the path, and runs `lint-imports` there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    with tempfile.TemporaryDirectory() as tmp:
        # Parents before children: a child's folder is copied into its parent's copy.
        for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
            target = Path(tmp, *package.split("."))
            shutil.copytree(REPO / folder, target, ignore=shutil.ignore_patterns("__pycache__"))
        env = {**os.environ, "PYTHONPATH": tmp}
        lint = Path(sys.executable).with_name("lint-imports")
        cmd = [str(lint), "--config", str(REPO / ".importlinter"), "--no-cache", *sys.argv[1:]]
        return subprocess.run(cmd, env=env, cwd=tmp).returncode


if __name__ == "__main__":
    raise SystemExit(main())
