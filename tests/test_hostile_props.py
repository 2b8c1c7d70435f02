"""Property tests (Hypothesis) of what a hostile file can hand the loaders and the CLI: each
input either validates or is refused with one line (exit 2 at the CLI), never a traceback,
never a write outside its root. Small example counts: these run in CI on two cores."""

from __future__ import annotations

import string
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from orchestrate.api import sealed
from orchestrate.api.config import ConfigError, Prompt, Workload, explain, load_workload
from orchestrate.api.paths import OutsideRoot, inside

CHEAP = settings(
    max_examples=40,
    deadline=None,
    database=None,  # no .hypothesis folder in the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
names = st.text(min_size=0, max_size=120) | st.sampled_from(
    ["..", ".", "a/../../b", "/etc/passwd", "a\\b", "con", "x" * 101, "ok-name_1.2@dev+x"]
)
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
# Workload-shaped mappings: the right keys with arbitrary values, so validation goes deep.
workloads = st.fixed_dictionaries(
    {
        "name": names,
        "prompts": st.lists(
            st.fixed_dictionaries({"id": names, "text": st.text(max_size=60)}), max_size=3
        )
        | values,
    },
    optional={
        "seeds": st.lists(st.integers(), max_size=4) | values,
        "save_audio": st.integers() | values,
        "sampling": st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers()}),
        "junk": values,
    },
)


@CHEAP
@given(name=names)
def test_a_name_validates_and_stays_under_its_root_or_is_one_line(
    name: str, tmp_path: Path
) -> None:
    try:
        prompt = Prompt(id=name, text="Hello.")
    except ValidationError as exc:
        assert "\n" not in explain(exc) and "prompt id" in explain(exc)
        return
    target = inside(tmp_path / "runs" / "job", Path("stock") / f"{prompt.id}_s42.wav")
    assert target.resolve().is_relative_to((tmp_path / "runs" / "job").resolve())


@CHEAP
@given(rel=st.text(max_size=40))
def test_inside_never_lets_a_path_out(rel: str, tmp_path: Path) -> None:
    try:
        path = inside(tmp_path, rel)
    except (OutsideRoot, ValueError):  # ValueError: a NUL byte, which no file name holds
        return
    assert path.resolve().is_relative_to(tmp_path.resolve()) and path.resolve() != tmp_path


@CHEAP
@given(data=workloads | values)
def test_a_generated_workload_file_validates_or_is_one_line(data: object, tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    try:
        assert isinstance(load_workload(str(path)), Workload)
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(str(path))


@CHEAP
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_as_a_workload_file_are_one_line(raw: bytes, tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_bytes(raw)
    try:
        load_workload(str(path))
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(str(path))


words = st.text(alphabet=string.ascii_letters + " ,.'", min_size=1, max_size=60)
invisible = st.sampled_from(["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u2066", "\u202e"])


@CHEAP
@given(text=words, mark=invisible, at=st.lists(st.integers(min_value=0), max_size=5))
def test_invisible_characters_never_change_the_normalised_text(
    text: str, mark: str, at: list[int]
) -> None:
    hidden = text
    for i in at:
        cut = i % (len(hidden) + 1)
        hidden = hidden[:cut] + mark + hidden[cut:]
    assert sealed.normalise(hidden) == sealed.normalise(text)


@CHEAP
@given(text=st.text(max_size=80))
def test_any_unicode_normalises_without_error_and_to_one_line(text: str) -> None:
    out = sealed.normalise(text)
    assert "\n" not in out and out == out.strip()


@settings(CHEAP, max_examples=8)
@given(data=workloads)
def test_the_cli_validates_or_exits_2_with_one_line_and_writes_nothing(
    data: object, tmp_path_factory
) -> None:
    """`run` with a generated workload and a database in a folder that does not exist: a bad
    workload is refused by its line, a good one reaches the database check; both exit 2 with
    one line, and nothing is written anywhere."""
    from orchestrate.cli import app

    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "w.yaml").write_text(yaml.safe_dump(data, allow_unicode=True))
    db = f"sqlite:///{tmp / 'missing' / 'o.db'}"
    args = ["run", "--stack", "cpu-fast", "--workload", str(tmp / "w.yaml"), "--db", db,
            "--runs-dir", str(tmp / "runs"), "--no-mlflow"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # not a traceback
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in tmp.iterdir()) == ["w.yaml"]
