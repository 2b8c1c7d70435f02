"""Issue 12, noise that refuses to lie: a too-noisy A/A spread writes no protocol, the
min_speedup derivation is shown, a new version gets its own file, `run --protocol` and its
edited-in-place refusal, and `diff` across protocol versions.

No model runs: A/A repeats are synthetic records (tests/factories.py) and `noise.measure` /
`runner.execute` are replaced, so every command runs in-process in well under a second.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from factories import fabricate_result, result_record, stack_result
from typer.testing import CliRunner

from orchestrate.api import protocol as proto
from orchestrate.api.config import CONFIG_DIR, StackSpec
from orchestrate.api.protocol import NoiseRule, Protocol, ProtocolError, load_protocol
from orchestrate.api.records import ResultRecord
from orchestrate.reports.run_diff import diff_runs
from orchestrate.research import noise
from orchestrate.research.scoring_run import StackQuality
from orchestrate.store.store import Store

DEFAULT_V1_HASH = "6976776577d9bc13"  # configs/protocol.yaml as recorded by earlier runs
NOISY = [0.2, 1.2, 0.5]  # per-repeat time scale: an A/A RTF spread like the issue's
QUIET = [1.0, 1.02, 0.99]


def aa_results(scales: list[float]) -> list[ResultRecord]:
    """One A/A job per repeat: stock and its copy, both timed at that repeat's scale."""
    stock = StackSpec(name="stock")
    return [
        result_record(
            [
                stack_result(stock, s, jitter=0.02, seed=2 * r),
                stack_result(noise.aa_copy(stock), s, jitter=0.02, seed=2 * r + 1),
            ]
        )
        for r, s in enumerate(scales)
    ]


def qualities(n: int) -> list[dict[str, StackQuality]]:
    vals = [{"wer": 0.1 + 0.01 * r, "cer": 0.05, "mos": 3.0, "sim": 0.9} for r in range(n)]
    return [{"stock": StackQuality(values=v), "stock.aa": StackQuality(values=v)} for v in vals]


def analysis_of(scales: list[float], protocol: Protocol | None = None) -> noise.NoiseAnalysis:
    runs = [f"run{r}" for r in range(len(scales))]
    return noise.analyse(runs, aa_results(scales), qualities(len(scales)), protocol or Protocol())


def rtf_cv(scales: list[float]) -> float:
    rtfs = [s.metrics["rtf"] for res in aa_results(scales) for s in res.results]
    return statistics.stdev(rtfs) / statistics.fmean(rtfs)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'runs.db'}"


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the working folder, holding a copy of configs/protocol.yaml."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "protocol.yaml").write_text((CONFIG_DIR / "protocol.yaml").read_text())
    return tmp_path


def cli(args: list[str], url: str) -> Any:
    from orchestrate.cli.app import app

    return CliRunner().invoke(app, [*args, "--db", url], catch_exceptions=False)


def fake_measure(monkeypatch: pytest.MonkeyPatch, scales: list[float]) -> None:
    """`noise.measure` returns the analysis of synthetic repeats under the given protocol."""

    def measure(store: Store, *, protocol: Protocol, **_: Any) -> noise.NoiseAnalysis:
        return analysis_of(scales, protocol)

    monkeypatch.setattr(noise, "measure", measure)


# ------------------------------------------------------- 1. too noisy: no protocol written


def test_a_noisy_aa_spread_is_refused_against_the_protocols_bound() -> None:
    analysis = analysis_of(NOISY)
    assert analysis.aa_cv == pytest.approx(rtf_cv(NOISY)) and analysis.aa_cv > 0.5
    assert len(analysis.aa_timing.values) == 2 * len(NOISY)  # stock and its copy, each repeat
    pct = f"{analysis.aa_cv * 100:.3g}%"
    with pytest.raises(noise.TooNoisy) as exc:
        noise.propose(Protocol(), analysis)
    assert str(exc.value).startswith(
        f"machine too noisy: sd/mean {pct} > 15% (protocol default v1 noise.max_aa_cv)"
    )
    assert "re-run on a quiet device" in str(exc.value)
    # the bound is the protocol's: just above the spread passes, just below refuses
    loose = Protocol(noise=NoiseRule(max_aa_cv=analysis.aa_cv * 1.01))
    assert noise.propose(loose, analysis).version == 2
    tight = Protocol(noise=NoiseRule(max_aa_cv=analysis.aa_cv * 0.99))
    with pytest.raises(noise.TooNoisy):
        noise.propose(tight, analysis)
    quiet = analysis_of(QUIET)
    assert quiet.aa_cv == pytest.approx(rtf_cv(QUIET)) and quiet.aa_cv < 0.15
    assert noise.propose(Protocol(), quiet).version == 2


def test_the_bound_is_named_in_the_protocol_without_changing_recorded_hashes() -> None:
    assert Protocol().noise.max_aa_cv == 0.15 == load_protocol().noise.max_aa_cv
    assert "max_aa_cv: 0.15" in (CONFIG_DIR / "protocol.yaml").read_text()
    # protocols hashed before the field existed keep their hash; another bound is another one
    assert Protocol().content_hash() == DEFAULT_V1_HASH == load_protocol().content_hash()
    assert Protocol(noise=NoiseRule(max_aa_cv=0.3)).content_hash() != DEFAULT_V1_HASH
    with pytest.raises(ValueError, match="max_aa_cv"):
        NoiseRule(max_aa_cv=0)


def test_noise_cli_on_a_noisy_machine_exits_4_and_writes_nothing(
    here: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_measure(monkeypatch, NOISY)
    before = (here / "protocol.yaml").read_text()
    out = cli(["noise", "--protocol", "protocol.yaml", "--no-mlflow"], url)
    assert out.exit_code == 4, out.output
    assert re.search(
        r"error: machine too noisy: sd/mean [\d.]+% > 15% \(protocol default v1 noise.max_aa_cv\)",
        out.stderr,
    )
    assert "min_speedup" in out.stdout  # the numbers are still shown
    assert (here / "protocol.yaml").read_text() == before and not (here / "protocols").exists()
    with Store(url) as store:
        assert [r["version"] for r in store.recorded_protocols()] == [1]
    as_json = cli(["noise", "--protocol", "protocol.yaml", "--no-mlflow", "--json"], url)
    assert as_json.exit_code == 4
    body = json.loads(as_json.stdout)
    assert body["protocol"] is None and body["refused"].startswith("machine too noisy")


# ------------------------------------------------------ 2. how min_speedup was derived


def test_min_speedup_derivation_spells_out_what_was_computed() -> None:
    analysis = analysis_of(QUIET)
    terms = analysis.min_speedup_terms
    assert [t["run"] for t in terms] == analysis.runs
    for t, check in zip(terms, analysis.aa, strict=True):
        assert t["bound"] == max(check.ci_high, 1 / check.ci_low)
    widest = max(t["bound"] for t in terms)
    assert analysis.min_speedup == noise._round_up(max(1.0, widest), 4)
    text = analysis.min_speedup_derivation
    assert text.startswith(f"min_speedup {analysis.min_speedup:g} = max(1, max over 3 repeats")
    assert "95% bootstrap (2000 resamples)" in text
    for t in terms:
        assert f"max({t['ci_high']:.4f}, 1/{t['ci_low']:.4f}) = {t['bound']:.4f}" in text
    assert text in noise.propose(Protocol(), analysis).speed.note  # kept in the protocol


def test_noise_cli_shows_the_derivation_in_table_and_json(
    here: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_measure(monkeypatch, QUIET)
    expected = analysis_of(QUIET)
    shown = cli(["noise", "--protocol", "protocol.yaml", "--no-mlflow"], url)
    assert shown.exit_code == 0, shown.output
    flat = " ".join(shown.stdout.split())  # rich wraps long lines
    assert " ".join(expected.min_speedup_derivation.split()) in flat
    assert "sd/mean" in flat
    body = json.loads(
        cli(["noise", "--protocol", "protocol.yaml", "--no-mlflow", "--json"], url).stdout
    )
    assert body["min_speedup_derivation"] == expected.min_speedup_derivation
    assert body["analysis"]["min_speedup_terms"] == expected.min_speedup_terms
    assert body["aa_cv"] == pytest.approx(expected.aa_cv) and body["max_aa_cv"] == 0.15


# --------------------------------------------------------- 3. a new version, its own file


def test_noise_writes_a_new_file_never_over_the_protocol_it_read(
    here: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_measure(monkeypatch, QUIET)
    before = (here / "protocol.yaml").read_text()
    first = cli(["noise", "--protocol", "protocol.yaml", "--no-mlflow"], url)
    assert first.exit_code == 0, first.output
    v2 = here / "protocols" / "default-v2.yaml"
    assert load_protocol(str(v2)).version == 2
    assert "max_aa_cv: 0.15" in v2.read_text()  # the bound is visible in every version
    assert (here / "protocol.yaml").read_text() == before
    assert "--protocol protocols/default-v2.yaml" in first.stdout
    # a second derivation from the same parent takes the next free number
    second = cli(["noise", "--protocol", "protocol.yaml", "--no-mlflow", "--json"], url)
    v3 = json.loads(second.stdout)["protocol"]
    assert v3["version"] == 3 and v3["use"] == "--protocol protocols/default-v3.yaml"
    assert load_protocol(v3["path"]).provenance.parent_version == 1
    # only an explicit --out replaces a file, and only with a newer version
    over = cli(["noise", "--protocol", "protocol.yaml", "--out", "protocol.yaml"], url)
    assert over.exit_code == 0 and load_protocol("protocol.yaml").version == 4
    # the default location for configs/protocol.yaml is configs/protocols/
    assert proto.version_path(Protocol(version=2), CONFIG_DIR / "protocol.yaml") == (
        CONFIG_DIR / "protocols" / "default-v2.yaml"
    )


# ------------------------------------------------------------ 4. run --protocol NAME|PATH


def fake_execute(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The executor's run of a claimed job, replaced: it records the job and says an
    identical run was recorded (nothing is measured)."""
    from orchestrate.running import executor

    jobs: list[Any] = []

    def run_claimed(store: Any, claim: Any, *_: Any, **__: Any) -> Any:
        jobs.append(claim.job)
        return SimpleNamespace(reused=True, run_id="0" * 32)

    monkeypatch.setattr(executor, "run_claimed", run_claimed)
    return jobs


def test_run_measures_under_the_protocol_it_is_given(
    here: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = fake_execute(monkeypatch)
    v2 = proto.bumped(Protocol(), speed={"min_speedup": 1.2})
    proto.write(v2, here / "v2.yaml")
    out = cli(["run", "--stack", "cpu-fast", "--protocol", "v2.yaml", "--no-mlflow"], url)
    assert out.exit_code == 0, out.output
    assert jobs[-1].protocol.content_hash() == v2.content_hash()
    with Store(url) as store:  # recorded, so an in-place edit of v2 is caught later
        assert [r["hash"] for r in store.recorded_protocols()] == [v2.content_hash()]
    default = cli(["run", "--stack", "cpu-fast", "--no-mlflow", "--force"], url)
    assert default.exit_code == 0 and jobs[-1].protocol.content_hash() == DEFAULT_V1_HASH
    missing = cli(["run", "--stack", "cpu-fast", "--protocol", "nosuch"], url)
    assert missing.exit_code == 2 and "nosuch.yaml" in missing.stderr
    resumed = cli(["run", "--resume", "abc", "--protocol", "v2.yaml"], url)
    assert resumed.exit_code == 2 and "drop --protocol" in resumed.stderr


# ------------------------------------------------ 5. an edited-in-place protocol is refused


def test_run_refuses_a_protocol_edited_in_place_as_the_gate_does(
    here: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = fake_execute(monkeypatch)
    edited_text = (here / "protocol.yaml").read_text() + "  k: 3.0\n"  # under noise:, still v1
    (here / "edited.yaml").write_text(edited_text)
    edited = load_protocol("edited.yaml")
    assert edited.version == 1 and edited.content_hash() != DEFAULT_V1_HASH
    with Store(url) as store:
        store.register_protocol(Protocol())  # default v1, as runs before recorded it
        with pytest.raises(ProtocolError) as gate_says:
            store.register_protocol(edited)  # the check gate.run_gate makes
    out = cli(["run", "--stack", "cpu-fast", "--protocol", "edited.yaml", "--no-mlflow"], url)
    assert out.exit_code == 2 and not jobs
    assert out.stderr.strip().splitlines() == [f"error: {gate_says.value}"]
    assert f"recorded with hash {DEFAULT_V1_HASH}" in out.stderr


# ----------------------------------------------- 6. diff across protocol versions refused


@pytest.fixture
def runs_under_two_protocols(url: str) -> tuple[str, str, str]:
    first = fabricate_result(job_id="first00001")
    job = first.job.model_copy(update={"job_id": "second0002", "protocol": Protocol(version=2)})
    with Store(url) as store:
        a = store.ingest(first)
        b = store.ingest(first.model_copy(update={"job": job}))
        c = store.ingest(first.model_copy(update={"job": first.job.model_copy(
            update={"job_id": "third00003"})}))  # fmt: skip
    return a, b, c


def test_diff_refuses_runs_under_different_protocols_unless_allowed(
    url: str, runs_under_two_protocols: tuple[str, str, str]
) -> None:
    a, b, c = runs_under_two_protocols
    with Store(url) as store:
        ra, rb, rc = (store.get_run(r, utterances=False) for r in (a, b, c))
    with pytest.raises(ProtocolError, match="different protocols") as exc:
        diff_runs(ra, rb)
    assert Protocol().content_hash() in str(exc.value)
    assert Protocol(version=2).content_hash() in str(exc.value)
    assert "--allow-protocol-mismatch" in str(exc.value)
    marked = diff_runs(ra, rb, allow_protocol_mismatch=True)
    assert marked.protocol_mismatch and "v2" in marked.protocol_mismatch
    assert diff_runs(ra, rc).protocol_mismatch is None  # same protocol: no mark

    refused = cli(["diff", a, b], url)
    assert refused.exit_code == 2 and "different protocols" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    allowed = cli(["diff", a, b, "--allow-protocol-mismatch"], url)
    assert allowed.exit_code == 0
    assert allowed.stdout.startswith("PROTOCOL MISMATCH") and "PROTOCOL MISMATCH" in allowed.stderr
    body = json.loads(cli(["diff", a, b, "--allow-protocol-mismatch", "--json"], url).stdout)
    assert "different protocols" in body["protocol_mismatch"]
    same = cli(["diff", a, c], url)
    assert same.exit_code == 0 and "MISMATCH" not in same.output
