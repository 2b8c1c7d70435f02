"""Writes stay under their root: a path built from a user's name is resolved and checked.

Names are validated where they are read (api.config.SAFE_NAME), so this is the second lock:
a name that slipped past validation (an old record, a hand-edited job.json, a symlink inside
the runs folder) still cannot write outside the folder it was meant for.
"""

from __future__ import annotations

from pathlib import Path


class OutsideRoot(ValueError):
    """A path built from a name would leave its root folder."""


def inside(root: Path, relative: str | Path) -> Path:
    """`root / relative`, refused (OutsideRoot) unless it resolves to somewhere under root."""
    path = Path(root) / relative
    base = Path(root).resolve()
    if not path.resolve().is_relative_to(base) or path.resolve() == base:
        raise OutsideRoot(f"{relative} would be written outside {root}; refused")
    return path
