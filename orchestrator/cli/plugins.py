"""`orchestrate families | techniques | stacks | explain`: what is installed and how it fits.

Registered into the main app by cli/app.py (`plugins_cli.register(app)`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from orchestrate.api.config import (
    EXPERIMENTS_DIR,
    ConfigError,
    StackSpec,
    load_model_spec,
    load_stack,
    read_yaml,
    search_path,
)
from orchestrate.api.registry import StackError, build_stack, catalogue, get_family
from orchestrate.api.technique import Refused
from orchestrate.cli.common import JsonOpt, console, fail, print_json


def families(as_json: JsonOpt = False) -> None:
    """List installed model-family plugins: slots, presets, defaults, and broken ones."""
    cat = catalogue()
    rows: list[dict[str, Any]] = [
        {
            "name": name,
            "slots": list(f.slots),
            "presets": list(f.presets),
            "baseline": f.baseline,
            "workload": f.workload,
            "summary": f.summary,
            "module": type(f).__module__,
        }
        for name, f in sorted(cat.families.items())
    ]
    rows += [_broken_row(b) for (group, _), b in sorted(cat.broken.items()) if group == "family"]
    if as_json:
        return print_json(rows)
    table = Table(title="model families")
    for col in ("name", "slots", "presets", "baseline", "workload", "summary"):
        table.add_column(col)
    for r in rows:
        if r.get("broken"):
            table.add_row(r["name"], f"[red]BROKEN: {r['error']}[/red]", "", "", "", r["target"])
            continue
        table.add_row(
            r["name"],
            ", ".join(r["slots"]),
            ", ".join(r["presets"]),
            r["baseline"],
            r["workload"],
            r["summary"],
        )
    console.print(table)


def techniques(as_json: JsonOpt = False) -> None:
    """List installed technique plugins with their metadata, and any that are broken."""
    cat = catalogue()
    rows: list[dict[str, Any]] = [
        {
            "name": n,
            "version": c.version,
            "family": c.family,
            "exact": c.exact,
            "slots": list(c.slots),
            "wraps": list(c.wraps),
            "requires": list(c.requires),
            "after": list(c.after),
            "conflicts": list(c.conflicts),
            "reduces": list(c.reduces),
            "summary": c.summary,
            "module": c.__module__,
            "params": c.Params.model_json_schema().get("properties", {}),
        }
        for n, c in sorted(cat.techniques.items())
    ]
    rows += [_broken_row(b) for (group, _), b in sorted(cat.broken.items()) if group == "technique"]
    if as_json:
        return print_json(rows)
    table = Table(title="techniques")
    for col in ("name", "family", "exact", "slots", "requires", "after", "summary"):
        table.add_column(col)
    for r in rows:
        if r.get("broken"):
            table.add_row(r["name"], "", "[red]BROKEN[/red]", "", "", "", r["error"])
            continue
        table.add_row(
            f"{r['name']}@{r['version']}",
            r["family"],
            "yes" if r["exact"] else "APPROX",
            ", ".join(r["slots"] + [f"~{w}" for w in r["wraps"]] + [f"-{c}" for c in r["reduces"]]),
            ", ".join(r["requires"]) or "-",
            ", ".join(r["after"]) or "-",
            r["summary"],
        )
    console.print(table)


def _broken_row(b: Any) -> dict[str, Any]:
    return {"name": b.name, "broken": True, "target": b.target, "error": b.error}


def stacks(as_json: JsonOpt = False) -> None:
    """List the stacks in ./experiments and the shipped experiments/: each one's family and
    whether it validates (and why not)."""
    rows = [_stack_row(path) for path in _stack_files()]
    if as_json:
        return print_json(rows)
    table = Table(title="stacks (experiments/)")
    for col in ("name", "family", "valid", "techniques", "exact", "description"):
        # fold: a reason is read whole, never cut at the column's edge
        table.add_column(col, overflow="fold")
    for r in rows:
        if r["valid"]:
            table.add_row(
                r["name"],
                r["family"],
                "yes",
                " -> ".join(r["techniques"]) or "(stock)",
                "yes" if r["exact"] else "APPROX",
                r["description"],
            )
        else:
            table.add_row(r["name"], r["family"] or "?", f"[red]no: {r['error']}[/red]", "", "", "")
    console.print(table)


def _stack_files() -> list[Path]:
    """Every stack file a name can resolve to, in lookup order (the working directory's
    ./experiments first): a user's file shadows a shipped one of the same name, as in
    `load_stack`, so the shipped one is not listed."""
    files: dict[str, Path] = {}
    for folder in search_path(EXPERIMENTS_DIR):
        for path in sorted(folder.glob("*.yaml")):
            files.setdefault(path.stem, path)
    return sorted(files.values(), key=lambda p: p.stem)


def _stack_row(path: Path) -> dict[str, Any]:
    """One stack file as a row: name, family, valid, and the techniques or the reason."""
    try:
        spec = load_stack(str(path))
        built = build_stack(spec)
    except (ConfigError, StackError) as exc:
        return {
            "name": path.stem,
            "family": _declared_family(path),
            "valid": False,
            "error": str(exc),
            "path": str(path),
        }
    return {
        "name": spec.name,
        "family": spec.family,
        "exact": built.exact,
        "techniques": [t.name for t in spec.techniques],
        "valid": True,
        "description": spec.description,
        "path": str(path),
    }


def _declared_family(path: Path) -> str | None:
    """The family an invalid stack file names (StackSpec's default when it names none), or
    None when the file is not a readable mapping or its family is not a string."""
    try:
        data = read_yaml(path)
    except ConfigError:
        return None
    family = data.get("family", StackSpec.model_fields["family"].default)
    return family if isinstance(family, str) else None


def explain(
    stack: Annotated[str, typer.Argument(help="Stack name (experiments/) or YAML path.")],
    model: Annotated[
        str | None,
        typer.Option(
            help="Model preset or weights folder (default: the family's first preset "
            "that runs on this machine's default device)."
        ),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """For each slot: stock's function, the technique's replacement (file:line:function),
    exact or approximate, and what it requires. Read off an engine built for the stack."""
    from orchestrate.running.explain import explain as explain_stack

    try:
        spec = load_stack(stack)
        family = get_family(spec.family)
        preset = model or _small_preset(family)
        result = explain_stack(spec, load_model_spec(preset, device=device))
    except (ConfigError, StackError, Refused, ValueError) as exc:
        fail(str(exc))
    if as_json:
        return print_json(asdict(result))
    title = f"{result.stack} ({result.family}) on {result.model}, {result.device}"
    table = Table(title=title)
    for col in ("slot", "stock", "this stack", "by", "exact", "needs"):
        table.add_column(col, overflow="fold")
    for line in result.slots:
        same = line.occupant == line.stock
        table.add_row(
            line.slot,
            line.stock,
            "(stock)" if same and line.filled_by is None else line.occupant,
            line.filled_by or "-",
            "-" if line.exact is None else ("yes" if line.exact else "APPROX"),
            ", ".join(line.requires) or "-",
        )
    console.print(table)
    for name, why in result.skipped.items():
        where = next(t["apply"] for t in result.techniques if t["name"] == name)
        console.print(f"[yellow]{name} not applied here[/yellow] ({why}); its apply: {where}")
    console.print(
        "exact/APPROX is what each technique declares; runs measure it against stock "
        "(the fidelity columns of `orchestrate show`)."
    )


def _small_preset(family: Any) -> str:
    """The family's CPU-sized preset: a preset whose config names the CPU as its device."""
    for preset in family.presets:
        try:
            if load_model_spec(preset).device == "cpu":
                return preset
        except ConfigError:
            continue
    raise ConfigError(f"family {family.name!r} has no CPU preset; pass --model")


def register(app: typer.Typer) -> None:
    for command in (families, techniques, stacks, explain):
        app.command()(command)
