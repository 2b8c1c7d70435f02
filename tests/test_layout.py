"""The package layout the README promises: every package folder installed under the
`orchestrate` namespace, and plugins that talk only through public, typed contracts."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_installed():
    listed = set(SETUPTOOLS["packages"])
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            name = ".".join([package, *rel.parts]) if rel.parts else package
            if "migrations" in rel.parts:
                continue  # alembic's folders ship as package data
            assert name in listed, f"{init.parent} is not in pyproject's packages ({name})"


def _private_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        # The project's own modules only: the OmniVoice family reuses a few private helpers
        # of the pinned `omnivoice` package on purpose (its loop, re-implemented draw for draw).
        internal = (
            node.module.startswith("orchestrate.")
            if isinstance(node, ast.ImportFrom) and node.module
            else False
        )
        if isinstance(node, ast.ImportFrom) and internal and node.level == 0:
            out += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return out


def test_no_plugin_imports_another_modules_private_names():
    offenders = []
    for folder in ("techniques", "families", "proposers"):
        for path in (REPO / folder).rglob("*.py"):
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in _private_imports(path)]
    assert not offenders, "private names imported across modules:\n" + "\n".join(offenders)


def test_no_engine_blackboard():
    # Techniques talk through typed slots; a shared `notes` dict hides who depends on whom.
    for folder in ("techniques", "families"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            assert "notes[" not in text and ".notes" not in text, path
