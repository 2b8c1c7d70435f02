"""What the report pages embed and how they are written: figures as base64 PNG (drawn
off-screen, the same on any machine) and the pages from their Jinja templates."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "templates"


def new_figure(figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A matplotlib figure and its axes, on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, same output on any machine
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)


def png_base64(fig: Any, dpi: int, pad: float = 1.08) -> str:
    """`fig` laid out tight, as base64 PNG; the figure is closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout(pad=pad)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def write_page(template: str, out: Path, **context: Any) -> Path:
    """Render `templates/<template>` with `context` to `out` (its folder made)."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(
        loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html", "j2"])
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(env.get_template(template).render(**context))
    return out
