"""Serving many streams (issue 34): the batched Rumik decode path, continuous batching, the
load driver's figures and bad loads. CPU, tiny model, float32."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrate.api.config import ModelSpec, SamplingConfig, StackSpec, TechniqueRef
from orchestrate.api.registry import build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.families.rumik.vocab import build_prompt
from orchestrate.running.serving import (
    Load,
    LoadError,
    StreamRecord,
    arrivals,
    check_load,
    drive,
    phase_breakdown,
    summarise,
    sustained,
)
from orchestrate.techniques.rumik.batched_server import (
    OVERLAP_PHASES,
    SYNC_PHASES,
    BatchedServer,
    ServeRequest,
    ServingError,
)

FAMILY = get_family("rumik")
GREEDY = SamplingConfig(top_k=1)
TOPK = SamplingConfig()  # T 0.8, k 30: the seeded per-row sampler
TEXTS = ["Hello there.", "A longer sentence to make a longer prompt.", "Short.", "Four!"]


@pytest.fixture(scope="module")
def model():
    return FAMILY.build_model(ModelSpec(preset="tiny", device="cpu", dtype="float32"))


def prompt(model, text: str) -> list[int]:
    return model.encode_prompt(build_prompt(text, "Ira", "neutral"))


def serve(
    model, reqs: list[ServeRequest], rows: int, sampling: SamplingConfig, **kw
) -> BatchedServer:
    server = BatchedServer(model, rows, 256, sampling, graphs=False, codec=True, **kw)
    waiting = list(reqs)
    while waiting or server.live():
        waiting = waiting[server.admit(waiting) :]
        server.step()
    return server


def test_decoding_counts_the_rows_sampling_and_the_positions_their_step_reads(model):
    """BatchedServer.decoding() (the profile's context_mean): after admission each row reads
    its prompt's positions in its first step; each step adds one a row; a finished row and
    a free one count for nothing."""
    reqs = [ServeRequest(k, prompt(model, t), 2 + k, seed=k) for k, t in enumerate(TEXTS[:2])]
    server = BatchedServer(model, 3, 256, TOPK, graphs=False, codec=False)
    assert server.decoding() == (0, 0)
    assert server.admit(reqs) == 2
    lengths = sum(len(r.prompt_ids) for r in reqs)
    assert server.decoding() == (2, lengths)
    server.step()
    assert server.decoding() == (2, lengths + 2)
    while server.live():
        server.step()
    assert server.decoding() == (0, 0)


def single_stream_tokens(model, ids: list[int], frames: int, head: str = "codebook") -> list[int]:
    """The family's single-stream stack with the same parts (static cache, packed
    projections, the codebook or audio head), host loop, greedy (top-k 1)."""
    spec = StackSpec(
        name="s",
        techniques=[TechniqueRef(name=n) for n in ("static_kv_cache", "packed_projections")]
        + [TechniqueRef(name=f"{head}_head")],
    )
    engine = FAMILY.build_engine(model, build_stack(spec, DeviceCaps("cpu"), strict=True))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        return engine.loop(engine, ids, frames, GREEDY, gen).tokens


@pytest.mark.parametrize("head", ["codebook", "audio"])
def test_batch_one_matches_the_single_stream_stack(model, head):
    ids = prompt(model, TEXTS[1])
    server = serve(model, [ServeRequest(0, ids, 6, seed=3)], rows=1, sampling=GREEDY, head=head)
    assert server.tokens[0] == single_stream_tokens(model, ids, 6, head)
    assert len(server.tokens[0]) == 48


@pytest.mark.parametrize("overlap", [False, True], ids=["codec-sync", "codec-overlap"])
@pytest.mark.parametrize("sampling", [GREEDY, TOPK], ids=["greedy", "seeded-top-k"])
def test_each_row_matches_its_batch_one_run(model, sampling, overlap):
    """Rows of different prompt lengths and budgets, 2 rows for 4 requests: freed rows are
    refilled mid-run, and every request's tokens equal its run alone (with the codec
    overlapped too, where rows are freed a step later)."""
    reqs = [ServeRequest(k, prompt(model, t), 2 + k, seed=100 + k) for k, t in enumerate(TEXTS)]
    together = serve(model, reqs, rows=2, sampling=sampling, codec_overlap=overlap)
    assert together.stats.prefills >= 3  # requests 2 and 3 went into freed rows
    for req in reqs:
        alone = serve(model, [req], rows=1, sampling=sampling)
        assert together.tokens[req.key] == alone.tokens[req.key], req.key
        assert len(alone.tokens[req.key]) == req.frames * 8


@pytest.mark.parametrize(
    "overlap, chunk_frames, kv",
    [
        (False, 1, "gather"),
        (True, 1, "gather"),
        (False, 3, "gather"),
        (True, 3, "gather"),
        (False, 3, "ring"),  # the codec's window in ring slots (mimi_stream.py)
    ],
    ids=["sync-1", "overlap-1", "sync-3", "overlap-3", "sync-3-ring"],
)
def test_each_streams_chunks_decode_to_its_whole_sequences_audio(model, chunk_frames, overlap, kv):
    """Streams in 2 rows for 4 requests (rows refilled mid-run, so the codec state is reset
    for a new stream), decoded chunk by chunk as frames complete: each stream's audio equals
    Mimi's decode of its whole code sequence. Decoding each chunk on its own, as this server
    once did, is off by the audio's own scale at the chunk edges."""
    reqs = [ServeRequest(k, prompt(model, t), 4 + k, seed=k) for k, t in enumerate(TEXTS)]
    server = serve(
        model, reqs, 2, TOPK, keep_audio=True, chunk_frames=chunk_frames, codec_overlap=overlap,
        codec_kv=kv,
    )  # fmt: skip
    assert server.codec is not None and server.codec.stream.kv == kv
    assert server.stats.prefills >= 3
    for req in reqs:
        got = np.concatenate(server.audio[req.key], axis=-1)
        codes = model.vocab.positional_codes(server.tokens[req.key])
        with torch.inference_mode():
            whole = model.codec.decode(codes).audio_values[0].numpy()
        assert got.shape == whole.shape == (1, (4 + req.key) * 1920)
        scale = np.abs(whole).max()
        assert np.abs(got - whole).max() <= 1e-5 * scale, req.key


@pytest.mark.parametrize(
    "every, overlap, pipeline",
    [(3, False, False), (3, True, False), (9, True, True)],  # 9: two chunks of a row between
)
def test_a_codec_launched_every_n_steps_decodes_fewer_times_to_the_same_audio(
    model, every, overlap, pipeline
):
    """codec_every=N: chunks completed over N steps decode together. Seven streams over three
    rows, admitted one a step so rows complete their chunks at different steps, refilled
    mid-run: the tokens are every-step's, each stream's audio is still Mimi's decode of its
    whole sequence, and there are fewer decodes."""
    reqs = [ServeRequest(k, prompt(model, TEXTS[k % 4]), 3 + k % 3, seed=k) for k in range(7)]
    runs = []
    for n in (1, every):
        server = BatchedServer(model, 3, 256, TOPK, graphs=False, codec=True, keep_audio=True,
                               codec_overlap=overlap, pipeline=pipeline, codec_every=n)  # fmt: skip
        waiting = list(reqs)
        while waiting or server.live():
            waiting = waiting[server.admit(waiting[:1]) :]  # one admission a step at most
            server.step()
        runs.append(server)
    each, batched = runs
    assert sorted(batched.tokens) == list(range(7))
    assert sum(batched.stats.codec_decodes.values()) < sum(each.stats.codec_decodes.values())
    for req in reqs:
        assert batched.tokens[req.key] == each.tokens[req.key]
        got = np.concatenate(batched.audio[req.key], axis=-1)
        with torch.inference_mode():
            codes = model.vocab.positional_codes(batched.tokens[req.key])
            whole = model.codec.decode(codes).audio_values[0].numpy()
        assert got.shape == whole.shape and np.abs(got - whole).max() <= 1e-5 * np.abs(whole).max()
    assert "launched every" in batched.described()["codec"]
    with pytest.raises(ServingError, match="codec_every must be at least 1"):
        BatchedServer(model, 2, 256, TOPK, graphs=False, codec=True, codec_every=0)


def test_padded_codec_decodes_give_the_unpadded_audio(model, monkeypatch):
    """Codec decodes padded to row buckets, as their CUDA graphs replay them (run eagerly
    here): 5 rows (buckets 1, 2, 4, 5), 8 streams of different lengths, so some decodes
    carry 3 rows padded to 4 with the scratch state row. Every stream's tokens and audio are
    the unpadded run's; with the padding written into row 0's state instead, they are not."""
    reqs = [ServeRequest(k, prompt(model, TEXTS[k % 4]), 2 + k % 5, seed=k) for k in range(8)]
    padded_calls = []

    def run(pad: bool, scratch: int | None = None) -> BatchedServer:
        server = BatchedServer(
            model, 5, 256, TOPK, graphs=False, codec=True, keep_audio=True, pad_codec=pad
        )
        assert server.codec is not None and server.codec.row_buckets == [1, 2, 4, 5]
        stream = server.codec.stream
        if scratch is not None:
            stream.scratch = scratch
        decode = stream.decode
        monkeypatch.setattr(
            stream, "decode", lambda r, c: padded_calls.append(r.tolist()) or decode(r, c)
        )
        waiting = list(reqs)
        while waiting or server.live():
            waiting = waiting[server.admit(waiting) :]
            server.step()
        return server

    def audio(server: BatchedServer) -> list[np.ndarray]:
        return [np.concatenate(server.audio[r.key], axis=-1) for r in reqs]

    plain = run(False)
    assert set(plain.stats.codec_decodes) == {"eager"}
    padded_calls.clear()
    padded = run(True)
    assert set(padded.stats.codec_decodes) == {"padded"}
    assert any(5 in rows for rows in padded_calls)  # a decode was padded (scratch row 5)
    assert padded.tokens == plain.tokens
    for a, b in zip(audio(plain), audio(padded), strict=True):
        assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    broken = run(True, scratch=0)
    assert any(
        a.shape != b.shape or np.abs(a - b).max() > 1e-3 * np.abs(a).max()
        for a, b in zip(audio(plain), audio(broken), strict=True)
    )


def test_padded_prompt_writes_give_the_unpadded_tokens(model):
    """Prompt writes padded to (rows, tokens) buckets, as their CUDA graphs replay them (run
    eagerly here): 39 rows admitted at once (two chunks, 32 and 7 rows, the 7 padded to 8
    with the scratch row) and a prompt longer than every length bucket (its chunk written
    at its own shape) give every request the tokens of unpadded writes."""
    long_text = " ".join(["a much longer prompt than the rest"] * 4)
    texts = [long_text] + [TEXTS[k % 4] for k in range(38)]
    reqs = [ServeRequest(k, prompt(model, t), 1, seed=k) for k, t in enumerate(texts)]
    assert len(reqs[0].prompt_ids) - 1 > 128  # beyond tiny's longest bucket (cache 256)
    runs = []
    for pad in (False, True):
        server = serve(model, reqs, 40, TOPK, pad_prefill=pad)
        runs.append(server.tokens)
        assert server.stats.prefills == 1
        if pad:
            assert server.prompts.row_buckets[-1] == 32 and server.prompts.token_buckets[-1] == 128
            assert server.stats.prefill_writes == {"eager": 1, "padded": 1}
    assert runs[0] == runs[1]


def test_paced_admissions_gather_arrivals_and_keep_every_rows_tokens(model):
    """Admissions at most every 4 steps while rows decode: streams arriving one by one are
    prefilled in fewer, larger admissions, each request's tokens unchanged."""
    reqs = [ServeRequest(k, prompt(model, TEXTS[k % 4]), 4, seed=k) for k in range(8)]
    arrivals = [0.004 * k for k in range(8)]  # about one a step on the clock below
    runs = []
    for every in (1, 4):
        server = BatchedServer(model, 8, 256, TOPK, graphs=False, codec=False, admit_every=every)
        ticks = iter(range(10_000))  # a clock that ticks 1 ms per read: arrivals by steps
        clock = functools.partial(lambda t: next(t) / 1000, ticks)
        records, _ = drive(server, reqs, arrivals, [4] * 8, 60, clock=clock)
        assert all(r.done for r in records)
        runs.append((server.tokens, server.stats.prefills))
    (tokens_1, prefills_1), (tokens_4, prefills_4) = runs
    assert tokens_1 == tokens_4
    assert prefills_4 <= prefills_1 - 2, (prefills_1, prefills_4)
    with pytest.raises(ServingError, match="admit_every must be at least 1"):
        BatchedServer(model, 2, 256, TOPK, graphs=False, codec=False, admit_every=0)


def test_a_pipelined_server_serves_the_tokens_and_audio_it_serves_unpipelined(model):
    """pipeline=True launches each step before the last one's tokens are handled (on the
    CPU the same order of work, run at once): seven requests over three rows, rows refilled
    and streams ending on their budgets mid-run, codec overlapped or left out: every request
    gets the tokens, the frames and (codec) the audio chunks of the unpipelined server,
    within a step per refill (none launched for rows about to end: budgets are known), and
    nothing is left in flight."""
    reqs = [ServeRequest(k, prompt(model, TEXTS[k % 4]), 2 + k % 3, seed=k) for k in range(7)]
    for codec in (True, False):
        runs = []
        for pipeline in (False, True):
            server = BatchedServer(model, 3, 256, TOPK, graphs=False, codec=codec,
                                   codec_overlap=codec, keep_audio=True,
                                   pipeline=pipeline)  # fmt: skip
            records, _ = drive(server, reqs, [0.0] * 7, [r.frames for r in reqs], 60)
            assert all(r.done for r in records) and server.inflight is None
            frames = {r.key: len(r.frame_ready_s) for r in records}
            runs.append((server.tokens, frames, server.audio, server.stats.steps))
        (tokens, frames, audio, steps), (p_tokens, p_frames, p_audio, p_steps) = runs
        assert sorted(tokens) == list(range(7)) and p_tokens == tokens and p_frames == frames
        assert all(len(tokens[k]) == 8 * reqs[k].frames for k in tokens)
        assert audio.keys() == p_audio.keys()
        for key, chunks in audio.items():
            assert all(np.array_equal(a, b) for a, b in zip(chunks, p_audio[key], strict=True))
        # a refilled row starts a step later (the step in flight was launched before it
        # was armed); budgets are known, so no step is launched for rows about to end
        assert steps <= p_steps <= steps + len(reqs) - 3
    with pytest.raises(ServingError, match="pipeline needs codec_overlap"):
        BatchedServer(model, 2, 256, TOPK, graphs=False, codec=True, pipeline=True)


def test_seeds_change_the_draw(model):
    ids = prompt(model, TEXTS[0])
    a = serve(model, [ServeRequest(0, ids, 4, seed=1)], 1, TOPK).tokens[0]
    b = serve(model, [ServeRequest(0, ids, 4, seed=2)], 1, TOPK).tokens[0]
    assert a != b


def test_refill_reuses_a_freed_row(model):
    server = BatchedServer(model, 1, 256, GREEDY, graphs=False, codec=False)
    first = ServeRequest(0, prompt(model, TEXTS[0]), 1, seed=0)
    second = ServeRequest(1, prompt(model, TEXTS[2]), 2, seed=0)
    assert server.admit([first, second]) == 1  # one row
    events = []
    while server.live():
        events += server.step()
    assert events[-1].key == 0 and events[-1].done
    assert server.admit([second]) == 1 and server.row_key[0] == 1
    while server.live():
        server.step()
    assert len(server.tokens[1]) == 16


def test_the_server_reads_the_models_own_weights_not_copies(model):
    server = BatchedServer(model, 2, 64, GREEDY, graphs=False, codec=False)
    memory = server.dec.memory()
    layer = model.lm.model.layers[0]
    packed = server.dec.proj.w_in[0]
    assert packed.untyped_storage().data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
    assert server.dec.proj.w_down[0] is layer.mlp.down_proj.weight
    # All that is copied: the codebook head's rows (8 codebooks' units + end), gathered.
    assert memory["weights_copied"] == server.dec.head_w.numel() * 4
    assert memory["weights_copied"] < memory["weights_read"] / 4
    cache = 2 * len(model.lm.model.layers) * 3 * 2 * 64 * model.config.head_dim * 4
    assert memory["cache"] == cache  # 2 rows + the scratch row, 2 kv heads, 64 positions


def test_a_replaced_weight_is_copied_not_aliased():
    from orchestrate.techniques.rumik.packed_projections import Packed

    fresh = FAMILY.build_model(ModelSpec(preset="tiny", device="cpu", dtype="float32"))
    layer = fresh.lm.model.layers[0]
    layer.self_attn.k_proj.weight = torch.nn.Parameter(layer.self_attn.k_proj.weight.clone())
    packed = Packed(
        get_family("rumik").build_engine(
            fresh, build_stack(StackSpec(name="s", techniques=[]), DeviceCaps("cpu"), strict=True)
        ),
        False,
    )
    assert packed.w_in[0].untyped_storage().data_ptr() != layer.self_attn.q_proj.weight.data_ptr()
    parts = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    parts += [layer.mlp.gate_proj, layer.mlp.up_proj]
    assert torch.equal(packed.w_in[0], torch.cat([p.weight for p in parts]))
    other = fresh.lm.model.layers[1]  # untouched: still the model's own tensor
    assert packed.w_in[1].data_ptr() == other.self_attn.q_proj.weight.data_ptr()


def test_request_beyond_the_cache_is_refused(model):
    server = BatchedServer(model, 1, 64, GREEDY, graphs=False, codec=False)
    with pytest.raises(ServingError, match="cache positions"):
        server.admit([ServeRequest(0, prompt(model, TEXTS[0]), 40, seed=0)])


def test_driver_times_every_frame(model):
    server = BatchedServer(model, 2, 256, GREEDY, graphs=False, codec=True)
    reqs = [ServeRequest(k, prompt(model, TEXTS[k]), 3, seed=k) for k in range(3)]
    records, wall = drive(server, reqs, [0.0, 0.0, 0.0], [3, 3, 3], time_limit_s=60)
    level = summarise(records, 0.08, 1)
    assert level["streams"] == 3 and level["incomplete"] == 0
    assert all(len(r.frame_ready_s) == 3 for r in records)
    assert level["ttfa_p50_s"] > 0 and wall > 0
    # Every phase the server ran is timed; together they fit inside the level's wall time.
    spent = server.phase_seconds()
    assert set(spent) == set(SYNC_PHASES) and all(spent[p] > 0 for p in SYNC_PHASES), spent
    assert sum(spent.values()) <= wall
    ms = phase_breakdown(spent, wall, server.stats.steps)
    assert ms["other"] >= 0 and sum(ms.values()) == pytest.approx(1000 * wall / server.stats.steps)
    server.clear()
    assert sum(server.phase_seconds().values()) == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["codec-sync", "codec-overlap"])
def test_a_row_is_freed_only_when_its_last_audio_is_ready(model, overlap):
    """One row, two requests: the second is admitted only after every frame of the first
    has its audio (a row reused earlier would reset the codec state the first still needs),
    and each stream's frames are all reported, the last with `done`."""
    server = BatchedServer(model, 1, 256, GREEDY, graphs=False, codec=True, codec_overlap=overlap)
    reqs = [ServeRequest(k, prompt(model, TEXTS[k]), 2, seed=k) for k in range(2)]
    records, wall = drive(server, reqs, [0.0, 0.0], [2, 2], time_limit_s=60)
    first, second = records
    assert first.done and second.done and len(first.frame_ready_s) == 2 == len(second.frame_ready_s)
    assert second.admitted_s >= first.frame_ready_s[-1]
    assert set(server.phase_seconds()) == set(OVERLAP_PHASES if overlap else SYNC_PHASES)
    if overlap:  # the CPU has no second stream: launched a step late
        assert server.phase_seconds()["codec_launch"] > 0
    spent = server.phase_seconds()  # no phase counted twice: together within the wall time
    assert sum(spent.values()) <= wall


def test_the_technique_parameter_overlaps_the_codec(model, tmp_path):
    """`batched_decode`'s `codec: overlap` reaches the server the worker drives: the load
    completes, and its record names the codec stream and times the launches."""
    from orchestrate.api.config import load_workload
    from orchestrate.running.serving import serve_stack

    spec = StackSpec(
        name="o",
        techniques=[TechniqueRef(name="batched_decode", params={"rows": 4, "codec": "overlap"})],
    )
    engine = FAMILY.build_engine(model, build_stack(spec, DeviceCaps("cpu"), strict=True))
    metrics, _ = serve_stack(FAMILY, engine, load_workload("serve-smoke"), tmp_path / "s.json")
    assert metrics["serve.streams"] == 3 and metrics["serve.incomplete"] == 0
    assert metrics["serve.phase_ms_per_step.codec_launch"] > 0
    assert "side CUDA stream" in json.loads((tmp_path / "s.json").read_text())["server"]["codec"]


def test_a_sustained_workload_reports_its_window_through_the_worker(model, tmp_path):
    """A workload's `sustained:` load reaches the worker's driver with the family's frame
    length: its metrics carry the sustained window's figures and live count."""
    from orchestrate.api.config import ServingLoad, load_workload
    from orchestrate.running.serving import serve_stack

    work = load_workload("serve-smoke")
    work = work.model_copy(
        update={"load": ServingLoad(sustained=2, duration_s=0.8, frames=4, time_limit_s=60)}
    )
    spec = StackSpec(name="b", techniques=[TechniqueRef(name="batched_decode", params={"rows": 4})])
    engine = FAMILY.build_engine(model, build_stack(spec, DeviceCaps("cpu"), strict=True))
    metrics, _ = serve_stack(FAMILY, engine, work, tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["load_label"] == "sustained 2 streams for 0.8 s"
    window = doc["sustained_window"]
    assert window["from_s"] == pytest.approx(0.32) and window["to_s"] == 0.8  # 4 frames of 80 ms
    assert metrics["serve.sustained_window.streams"] == window["streams"] >= 1
    assert window["live_mean"] > 0 and metrics["serve.sustained_window.live_max"] >= 1
    assert doc["gc"]["frozen"] is False and set(doc["gc"]) == {"frozen", "gen0", "gen1", "gen2"}


def test_a_server_without_its_codec_spends_nothing_there(model):
    server = BatchedServer(model, 2, 256, GREEDY, graphs=False, codec=False)
    reqs = [ServeRequest(k, prompt(model, TEXTS[k]), 2, seed=k) for k in range(2)]
    drive(server, reqs, [0.0, 0.0], [2, 2], time_limit_s=60)
    spent = server.phase_seconds()
    assert spent["codec"] == 0 and spent["step"] > 0 and spent["prefill"] > 0


def test_the_collector_watch_records_each_collection_and_unfreezes_the_heap():
    """Each collection inside the block is recorded by generation, its pause measured; a
    frozen heap is frozen only inside the block, and the callback leaves with it."""
    import gc

    from orchestrate.running import gc_watch

    with gc_watch.watch() as seen:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    counts = seen.summary()
    assert counts["gen0"]["count"] == 1 and counts["gen2"]["count"] == 2
    assert 0 < counts["gen2"]["max_ms"] <= counts["gen2"]["total_ms"]
    assert seen not in gc.callbacks
    assert gc.get_freeze_count() == 0
    with gc_watch.watch(freeze=True) as frozen:
        assert gc.get_freeze_count() > 1000  # torch's and the test's objects, at least
        gc.collect(2)
    assert gc.get_freeze_count() == 0 and frozen.summary()["frozen"] is True
    assert frozen.summary()["gen2"]["count"] == 1


def test_underruns_are_counted_per_chunk():
    # First chunk ready at 1.0; chunk 1 due 1.08 (ready 1.05: on time), chunk 2 due 1.16
    # (ready 1.30: late), chunk 3 due 1.24 (ready 1.31: late).
    rec = StreamRecord(0, 0.5, 4, 0.5, [1.0, 1.05, 1.30, 1.31], done=True)
    level = summarise([rec], 0.08, 1)
    assert level["underruns_total"] == 2 and level["served"] == 0 and level["behind"] == 1
    assert level["ttfa_p50_s"] == pytest.approx(0.5)
    ok = StreamRecord(1, 0.0, 2, 0.0, [0.1, 0.15], done=True)
    assert summarise([ok], 0.08, 1)["served"] == 1


@pytest.mark.parametrize(
    "load, message",
    [
        (Load(concurrency=0), "at least 1"),
        (Load(concurrency=9), "exceeds the cache's 8 rows"),
        (Load(rate=5.0), "without a duration"),
        (Load(duration_s=3.0), "needs an arrival rate"),
        (sustained(9, 20.0, 6.4), "a sustained 9 live streams exceed the cache's 8 rows"),
    ],
)
def test_bad_loads(load, message):
    with pytest.raises(LoadError, match=message):
        check_load(load, rows=8)


def test_a_sustained_load_keeps_its_streams_playing_and_opens_its_window_after_one():
    """600 streams of 6.4 s kept playing: 93.75 arrivals a second (Little's law), the window
    opening at 6.4 s; arrivals shorter than two streams leave no window."""
    load = sustained(600, 20.0, 6.4)
    assert load.rate == pytest.approx(93.75) and load.window_from_s == 6.4
    assert load.label() == "sustained 600 (poisson 93.75/s for 20 s)"
    with pytest.raises(LoadError, match="no sustained window"):
        sustained(600, 12.0, 6.4)
    with pytest.raises(LoadError, match="at least 1 live stream"):
        sustained(0, 20.0, 6.4)


def test_the_sustained_window_counts_only_its_streams_and_time():
    """Streams arriving before the window or after its end are left out of its figures;
    its live count is time-weighted over the window alone."""
    load = Load(rate=4.0, duration_s=1.6, live=2, window_from_s=0.6)

    def stream(key: int, arrival: float, late: bool) -> StreamRecord:
        ready = [arrival + 0.05, arrival + 0.13 + (0.5 if late else 0.0)]
        return StreamRecord(key, arrival, 2, arrival, ready, done=True)

    records = [stream(0, 0.0, True), stream(1, 0.7, False), stream(2, 1.5, True)]
    trace = [(0.0, 1), (1.0, 3), (2.0, 2), (3.0, 0)]
    level = summarise(records, 0.08, 1, load, trace)
    window = level["sustained_window"]
    assert level["streams"] == 3 and window["streams"] == 2  # stream 0 came before it
    assert window["served"] == 1 and window["behind"] == 1
    assert (window["from_s"], window["to_s"]) == (0.6, 1.6)
    # 0.4 s with 1 live, 0.6 s with 3 live: (0.4 * 1 + 0.6 * 3) / 1.0
    assert window["live_mean"] == pytest.approx(2.2) and window["live_max"] == 3
    assert "sustained_window" not in summarise(records, 0.08, 1, Load(concurrency=3), trace)


def test_the_loop_gaps_come_from_the_trace_level_wide_and_in_the_window():
    """loop_ms: step-end to step-end gaps from the driver's trace; the window's are those
    ending inside it (a long step at 1.2 s counts there, the 5 ms ones before it do not)."""
    trace = [(0.0, 1), (0.005, 1), (0.010, 1), (1.0, 2), (1.01, 2), (1.2, 2), (1.21, 2), (2.5, 0)]
    rec = StreamRecord(0, 0.0, 1, 0.0, [0.5], done=True)
    load = Load(rate=1.0, duration_s=1.5, live=1, window_from_s=1.0)
    level = summarise([rec], 0.08, 1, load, trace)
    assert level["loop_ms_max"] == pytest.approx(1290.0)
    assert level["loop_ms_p50"] == pytest.approx(10.0)
    window = level["sustained_window"]
    assert window["loop_ms_max"] == pytest.approx(190.0)  # 1.01 -> 1.2
    assert window["loop_ms_p50"] == pytest.approx(10.0)
    assert "loop_ms_p50" not in summarise([rec], 0.08, 1)  # no trace: no figure


def test_poisson_arrivals_are_seeded_and_bounded():
    load = Load(rate=50.0, duration_s=2.0)
    a, b = arrivals(load, 1), arrivals(load, 1)
    assert a == b and all(0 < t <= 2.0 for t in a) and 60 < len(a) < 140


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_buckets_match_eager_on_gpu(dtype):
    """CUDA graphs per (batch, context) bucket replay the eager step: same tokens per row,
    with rows refilled mid-run (float32 and bfloat16; greedy and seeded top-k alike)."""
    gpu_model = FAMILY.build_model(ModelSpec(preset="tiny", device="cuda", dtype=dtype))
    reqs = [
        ServeRequest(k, prompt(gpu_model, t), 3 + 2 * k, seed=7 + k) for k, t in enumerate(TEXTS)
    ]
    runs = []
    for graphs in (False, True):  # the decode steps', padded prompt writes' and codec's graphs
        server = BatchedServer(gpu_model, 2, 256, TOPK, graphs=graphs, codec=True)
        assert server.codec is not None
        assert server.warm_up() == (
            len(server.batch_buckets) * len(server.ctx_buckets)
            + len(server.prompts.row_buckets) * len(server.prompts.token_buckets)
            + len(server.codec.row_buckets)
            if graphs
            else 0
        )
        waiting = list(reqs)
        while waiting or server.live():
            waiting = waiting[server.admit(waiting) :]
            server.step()
        runs.append(server.tokens)
        assert set(server.stats.prefill_writes) == ({"graph"} if graphs else {"eager"})
    assert runs[0] == runs[1]


def test_the_codecs_precision_reaches_the_server_and_leaves_the_models_codec(model):
    """batched_decode's codec_precision and codec_every (version 9): bf16 decodes with a
    bfloat16 copy (the model's own Mimi stays float32 for everything else), tf32 is a CUDA
    matmul mode and is refused on the CPU when the stack is applied."""
    from orchestrate.api.technique import Refused

    def built(precision: str, every: int = 1):
        params = {"rows": 2, "codec_precision": precision, "codec_every": every}
        ref = TechniqueRef(name="batched_decode", params=params)
        return build_stack(StackSpec(name="codec-precision", family="rumik", techniques=[ref]))

    engine = FAMILY.build_engine(model, built("bf16", every=4))
    server = engine.server(engine, 64, SamplingConfig(top_k=1), 1, rows=2)
    assert server.codec.stream.dtype == torch.bfloat16 and server.codec_every == 4
    assert next(model.codec.parameters()).dtype == torch.float32
    assert "bfloat16" in server.described()["codec"]
    with pytest.raises(Refused, match="codec_precision 'tf32' needs a CUDA device"):
        FAMILY.build_engine(model, built("tf32"))


@pytest.mark.gpu
def test_an_approximate_codec_serves_nearby_audio_on_gpu(monkeypatch):
    """tf32 and bf16 codecs, graphed on the side stream beside pipelined steps: each stream's
    audio is Mimi's whole-sequence float32 decode of its own tokens within 5% of its peak
    (rounding, not a broken state), and bf16's is further from it than fp32's on every
    stream (the copy is in effect). tf32's may equal fp32's: the tiny codec's matmuls (32
    and 64 wide) stay on cuBLAS's SIMT kernels with TF32 allowed (measured on an H200), so
    ChunkCodec's flag is checked instead. Tokens are not compared across runs: a refill's
    step depends on when audio is ready, and GPU float32 logits on the batch's bucket."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    gpu_model = FAMILY.build_model(ModelSpec(preset="tiny", device="cuda", dtype="float32"))
    reqs = [
        ServeRequest(k, prompt(gpu_model, t), 3 + 2 * k, seed=7 + k) for k, t in enumerate(TEXTS)
    ]
    errors: dict[str, list[float]] = {}
    for precision in ("fp32", "tf32", "bf16"):
        server = BatchedServer(
            gpu_model, 2, 256, TOPK, graphs=True, codec=True, keep_audio=True,
            codec_overlap=True, pipeline=True, codec_precision=precision,
        )  # fmt: skip
        server.warm_up()
        records, _ = drive(server, reqs, [0.0] * 4, [r.frames for r in reqs], time_limit_s=120)
        assert all(r.done and len(r.frame_ready_s) == r.frames for r in records)
        for req in reqs:
            got = np.concatenate(server.audio[req.key], axis=-1)
            with torch.inference_mode():
                codes = gpu_model.vocab.positional_codes(server.tokens[req.key]).cuda()
                whole = gpu_model.codec.decode(codes).audio_values[0].cpu().numpy()
            assert got.shape == whole.shape, (precision, req.key)
            errors.setdefault(precision, []).append(
                float(np.abs(got - whole).max() / np.abs(whole).max())
            )
        if precision == "tf32":
            with server.codec._matmul_mode():
                assert torch.backends.cuda.matmul.allow_tf32
            assert not torch.backends.cuda.matmul.allow_tf32  # restored
    assert max(max(e) for e in errors.values()) <= 0.05, errors
    assert all(b > f for b, f in zip(errors["bf16"], errors["fp32"], strict=True)), errors


@pytest.mark.gpu
def test_the_codecs_graphs_and_side_stream_give_the_eager_codecs_audio_on_gpu(monkeypatch):
    """The codec eager between graphed steps, then replayed from its row buckets' graphs,
    then on its own CUDA stream as well, then with its window in ring slots, read by SDPA
    and then in place by the ring kernel (inside the codec's graphs): every stream's
    tokens are equal, and its audio too, within 1e-5 of its peak (float32 with TF32 off:
    padded batches pick other convolution algorithms, and TF32's 10-bit products differ by
    about 1e-3), with rows refilled mid-run."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    gpu_model = FAMILY.build_model(ModelSpec(preset="tiny", device="cuda", dtype="float32"))
    reqs = [
        ServeRequest(k, prompt(gpu_model, t), 3 + 2 * k, seed=7 + k) for k, t in enumerate(TEXTS)
    ]
    runs = []
    for overlap, pad, kv, attention in (
        (False, False, "gather", "sdpa"), (False, None, "gather", "sdpa"),
        (True, None, "gather", "sdpa"), (True, None, "ring", "sdpa"),
        (True, None, "ring", "triton"),
    ):  # fmt: skip
        server = BatchedServer(
            gpu_model, 2, 256, TOPK, graphs=True, codec=True, keep_audio=True,
            codec_overlap=overlap, pad_codec=pad, codec_kv=kv, codec_attention=attention,
        )  # fmt: skip
        server.warm_up()
        records, _ = drive(server, reqs, [0.0] * 4, [r.frames for r in reqs], time_limit_s=120)
        assert all(r.done and len(r.frame_ready_s) == r.frames for r in records)
        assert set(server.stats.codec_decodes) == ({"eager"} if pad is False else {"graph"})
        runs.append(server)
    eager, graphed, overlapped, ring, ring_kernel = runs
    assert overlapped.codec.side is not None and overlapped.phase_seconds()["codec_launch"] > 0
    assert ring_kernel.codec.stream.ring_attention is not None
    for other in (graphed, overlapped, ring, ring_kernel):
        assert eager.tokens == other.tokens
        for req in reqs:
            a = np.concatenate(eager.audio[req.key], axis=-1)
            b = np.concatenate(other.audio[req.key], axis=-1)
            assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), req.key


@pytest.mark.gpu
def test_the_kernels_graphed_buckets_match_its_eager_steps_on_gpu():
    """attention='triton' (head_dim 128: the small-128 preset): one context bucket, graphs
    per batch bucket replay the eager steps, rows refilled mid-run; and the SDPA path and
    the kernel glue (graphed) give the same tokens (float32, greedy)."""
    gpu_model = FAMILY.build_model(ModelSpec(preset="small-128", device="cuda", dtype="float32"))
    reqs = [
        ServeRequest(k, prompt(gpu_model, t), 3 + 2 * k, seed=7 + k) for k, t in enumerate(TEXTS)
    ]
    runs = []
    for attention, graphs, glue in (
        ("triton", False, "torch"), ("triton", True, "torch"), ("sdpa", False, "torch"),
        ("triton", True, "triton"),
    ):  # fmt: skip
        server = BatchedServer(
            gpu_model, 2, 256, GREEDY, graphs=graphs, codec=False, attention=attention, glue=glue
        )
        if attention == "triton":
            assert server.ctx_buckets == [256]
        server.warm_up()
        waiting = list(reqs)
        while waiting or server.live():
            waiting = waiting[server.admit(waiting) :]
            server.step()
        runs.append(server.tokens)
    assert runs[0] == runs[1] == runs[2] == runs[3]


@pytest.mark.gpu
def test_an_int4_cache_graphed_serves_its_eager_steps_tokens_on_gpu():
    """kv int4 (packed 4-bit keys and values, written by the rotary kernel) with chunked
    prefill, float32, greedy, two rows refilled by four requests: the graphed server gives
    the eager server's tokens, and its cache is uint8, two values a byte."""
    gpu_model = FAMILY.build_model(ModelSpec(preset="small-128", device="cuda", dtype="float32"))
    reqs = [
        ServeRequest(k, prompt(gpu_model, t), 3 + 2 * k, seed=7 + k) for k, t in enumerate(TEXTS)
    ]
    runs = []
    for graphs in (False, True):
        server = BatchedServer(gpu_model, 2, 256, GREEDY, graphs=graphs, codec=False,
                               attention="triton", glue="triton", chunk_tokens=64,
                               kv="int4")  # fmt: skip
        server.warm_up()
        waiting = list(reqs)
        while waiting or server.live():
            waiting = waiting[server.admit(waiting) :]
            server.step()
        runs.append(server.tokens)
    assert server.dec.k.dtype == torch.uint8
    assert server.dec.k.shape[-1] * 2 == gpu_model.config.head_dim
    assert sorted(runs[0]) == [0, 1, 2, 3]
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_chunked_prefill_graphed_serves_the_tokens_prompt_writes_serve_on_gpu():
    """chunk_tokens 16 and 64 (and 64 pipelined) with graphs (one per batch and chunk
    bucket, captured in warm_up), kernel glue, float32, greedy, two rows refilled by four
    requests: each request's tokens are those of the same server writing its prompts
    apart."""
    gpu_model = FAMILY.build_model(ModelSpec(preset="small-128", device="cuda", dtype="float32"))
    reqs = [
        ServeRequest(k, prompt(gpu_model, t), 3 + 2 * k, seed=7 + k) for k, t in enumerate(TEXTS)
    ]
    runs = []
    for chunk, pipeline in ((0, False), (16, False), (64, False), (64, True)):
        server = BatchedServer(gpu_model, 2, 256, GREEDY, graphs=True, codec=False,
                               attention="triton", glue="triton", chunk_tokens=chunk,
                               pipeline=pipeline)  # fmt: skip
        captured = server.warm_up()
        if chunk:
            assert captured == len(server.batch_buckets) * (1 + len(server.chunk_buckets))
        waiting = list(reqs)
        while waiting or server.live():
            waiting = waiting[server.admit(waiting) :]
            server.step()
        assert (server.stats.prefill_writes.get("chunk", 0) > 0) == (chunk > 0)
        runs.append(server.tokens)
    assert sorted(runs[0]) == [0, 1, 2, 3]
    assert runs[0] == runs[1] == runs[2] == runs[3]


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [0, 64])
def test_a_pipelined_server_waits_for_the_gpu_only_to_read_tokens_on_gpu(chunk):
    """Pipelined, the host handles a step's tokens while the next step runs: admitting,
    holding, arming and retiring rows must not wait for it. `t[rows] = 0` with a CUDA index
    does (torch copies the scalar with a blocking copy: a stream sync); on the H100 the
    pipelined server made eight a step that way. Every sync left is a step's readback or
    the codec's wait with no step to overlap, rows refilled mid-run, codec on its stream."""
    from orchestrate.api.device import sync_sites

    gpu_model = FAMILY.build_model(ModelSpec(preset="small-128", device="cuda", dtype="float32"))
    reqs = [
        ServeRequest(k, prompt(gpu_model, t), 3 + 2 * k, seed=7 + k) for k, t in enumerate(TEXTS)
    ]
    server = BatchedServer(gpu_model, 2, 256, TOPK, graphs=True, codec=True, codec_overlap=True,
                           codec_kv="ring", attention="triton", glue="triton",
                           chunk_tokens=chunk, pipeline=True)  # fmt: skip
    server.warm_up()
    with sync_sites(Path(__file__).resolve().parents[1]) as syncs:
        records, _ = drive(server, reqs, [0.0] * 4, [r.frames for r in reqs], time_limit_s=120)
    assert all(r.done and len(r.frame_ready_s) == r.frames for r in records)
    innermost = {site.split(" < ")[0] for site in syncs}
    where = {(s.split(":")[0], s.rsplit(" ", 1)[1]) for s in innermost}
    assert where <= {("techniques/rumik/batched_server.py", "step"),
                     ("techniques/rumik/chunk_codec.py", "wait")}, dict(syncs)  # fmt: skip
    assert sum(syncs.values()) <= server.stats.steps + len(reqs) * 4  # about one a step


def _bench():
    from factories import benchmark

    return benchmark("serving_bench")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--levels", "0"], "concurrency must be at least 1"),
        (["--levels", "2,8", "--rows", "4"], "exceeds the cache's 4 rows"),
        (["--poisson", "5"], "without a duration"),
        (["--attention", "flash"], "each one of sdpa, triton"),
        (["--attention", "sdpa,triton"], "--attention triton needs --device cuda"),
        (["--levels", "2", "--batch1-vs", "cpu-fast"], "--levels must include 1"),
        (["--levels", "1", "--batch1-vs", "no-such-stack"], "--batch1-vs: "),
        (["--glue", "fused"], "--glue 'fused': each one of torch, triton"),
        (["--glue", "torch,triton"], "--glue triton needs --attention triton alone"),
        (["--codec-attention", "triton"], "--codec-attention triton needs --codec-kv ring"),
        (["--chunk-tokens", "64"], "--chunk-tokens above 0 needs --glue triton alone"),
        (["--chunk-tokens", "sixty"], "--chunk-tokens 'sixty': each 0 to 1024"),
        (["--pipeline", "yes"], "--pipeline 'yes': off, on or off,on"),
        (["--pipeline", "on"], "--pipeline on needs --codec overlap alone"),
        (["--sync-sites"], "--sync-sites counts CUDA synchronisations: it needs --device cuda"),
        (["--profile-gpu", "10:5"], "--profile-gpu records GPU activity: it needs --device cuda"),
        (["--codec-precision", "fp16"], "--codec-precision 'fp16': each one of fp32, tf32, bf16"),
        (["--codec-precision", "fp32,tf32"], "--codec-precision tf32 needs --device cuda"),
        (["--codec-precision", "bf16", "--no-codec"], "there is no codec to run"),
        (["--codec-every", "1,0"], "--codec-every '1,0': each a whole number, at least 1"),
        (["--attention-block", "96"], "--attention-block '96': each one of 32, 64, 128"),
        (["--attention-block", "64,128"], "other than 128 needs --attention triton alone"),
        (["--path", "attention=sdpa,speed=11"], "KEY=VALUE pairs, each key one of attention"),
        (
            ["--path", "codec=overlap", "--glue", "triton"],
            "--path spells out each path: drop --glue",
        ),
        (["--path", "kv=fp8"], "--path 'kv=fp8': --kv fp8 needs --attention triton alone"),
        (["--kv", "int4"], "--kv int4 needs --attention triton alone"),
        (["--kv", "int8"], "--kv 'int8': each one of model, fp8, int4"),
        (["--path", "codec_kv=ring", "--path", "codec_kv=gather"], "make the same path"),
    ],
)
def test_benchmark_refuses_bad_loads_before_building(monkeypatch, capsys, argv, message):
    import orchestrate.api.registry as registry

    def no_model(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(registry, "get_family", no_model)
    assert _bench().main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_benchmark_end_to_end_on_cpu(tmp_path):
    import json

    out = tmp_path / "s.json"
    argv = ["--device", "cpu", "--levels", "1,2", "--baseline-levels", "2", "--frames", "2"]
    argv += ["--sustained", "2:0.4"]  # streams of 0.16 s: a window from 0.16 s to 0.4 s
    argv += ["--batch1-vs", "cpu-fast", "--batch1-repeats", "2"]
    assert _bench().main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    batch1 = doc["batch1"]  # cpu-fast's single stream against ours at 1 stream
    assert batch1["stack"] == "cpu-fast" and len(batch1["ms_per_token"]) == 2
    assert batch1["ours"]["ours"] > 0 and batch1["ours_over_stack"]["ours"] == pytest.approx(
        batch1["ours"]["ours"] / batch1["median_ms_per_token"]
    )
    assert doc["complete"] and not doc["skipped"]
    paths = [(lv["path"], lv["concurrency"] or lv["live"]) for lv in doc["levels"]]
    assert paths == [("ours", 1), ("ours", 2), ("baseline_b", 2), ("ours", 2)]
    sustained_level = doc["levels"][-1]
    assert sustained_level["load"].startswith("sustained 2 (poisson 12.5/s for 0.4 s)")
    assert sustained_level["sustained_window"]["from_s"] == pytest.approx(0.16)
    assert out.with_suffix(".png").stat().st_size > 0  # the figure, sustained level drawn
    for lv in doc["levels"][:3]:
        assert "error" not in lv, lv.get("traceback")
        assert lv["streams"] == lv["concurrency"] and lv["incomplete"] == 0
        assert lv["ttfa_p95_s"] > 0 and lv["audio_s"] == pytest.approx(lv["streams"] * 0.16)
        if lv["path"] == "ours":  # where its step goes; baseline B is one generate() call
            assert lv["phase_ms_per_step"]["step"] > 0 and lv["phase_ms_per_step"]["codec"] > 0
    assert doc["environment"]["git_sha"] and doc["not_built"]
    assert all(lv["gc"]["frozen"] is False for lv in doc["levels"] if lv["path"] == "ours")
    assert all(lv["chunk_prompt_tokens"] == 0 for lv in doc["levels"] if lv["path"] == "ours")
    assert doc["ours"]["paths"]["ours"]["phases"] == ["prefill", "step", "codec", "host"]
    assert set(doc["ours"]["phases"]) >= set(doc["ours"]["paths"]["ours"]["phases"])  # defined


def test_paths_spelled_out_run_each_with_its_own_options(tmp_path):
    """--path runs exactly the paths asked for, not the product of the comma lists (the
    issue's curve: a plain stack, our best and baseline B in one run), each recording its
    own options, codec options included."""
    import gc
    import json

    out = tmp_path / "p.json"
    argv = ["--device", "cpu", "--levels", "2", "--baseline-levels", "", "--frames", "2"]
    argv += ["--path", "attention=sdpa", "--path", "codec=overlap,codec_every=2,codec_kv=ring"]
    argv += ["--path", "codec_precision=bf16", "--gc", "freeze"]
    assert _bench().main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert all(lv["gc"]["frozen"] for lv in doc["levels"])  # the warm heap frozen out
    assert gc.get_freeze_count() == 0  # and put back after each level
    assert [lv["path"] for lv in doc["levels"]] == ["ours", "ours_overlap_cev2", "ours_cbf16"]
    # a --path's approximate codec is measured and defined, though --codec-precision is fp32
    assert "codec_vs_fp32" in doc["ours"]["paths"]["ours_cbf16"]
    assert "codec_vs_fp32" in doc["definitions"]
    assert all("error" not in lv and lv["streams"] == 2 for lv in doc["levels"])
    paths = doc["ours"]["paths"]
    assert (paths["ours"]["codec"], paths["ours"]["codec_kv"]) == ("sync", "gather")
    assert paths["ours_overlap_cev2"]["codec_every"] == 2
    assert paths["ours_overlap_cev2"]["codec_kv"] == "ring"


def test_the_figure_draws_every_path_the_record_has():
    """The figure's curves come from the record's paths (a fixed list once left every
    suffixed path, _pipe, _glue, _chunkN, undrawn); ours are labelled by what tells them
    apart, baseline B keeps its style."""
    levels = [{"path": p} for p in ("ours_x_fp8_pipe", "ours_x_fp8_cev4_pipe", "baseline_b")]
    styles, shared = _bench().curve_styles({"levels": levels})
    assert shared == "ours_x_fp8"
    assert {k: v[2] for k, v in styles.items()} == {
        "ours_x_fp8_pipe": "pipe", "ours_x_fp8_cev4_pipe": "cev4_pipe", "baseline_b": "baseline_b"
    }  # fmt: skip
    assert styles["baseline_b"][0] == "s--" and len({v[1] for v in styles.values()}) == 3
    alone, shared = _bench().curve_styles({"levels": [{"path": "ours_triton"}]})
    assert alone["ours_triton"][2] == "ours_triton" and shared == ""


def test_benchmark_bf16_codec_path_records_its_audio_against_fp32(tmp_path):
    import json

    out = tmp_path / "s.json"
    argv = ["--device", "cpu", "--levels", "2", "--baseline-levels", "", "--frames", "2"]
    assert _bench().main([*argv, "--codec-precision", "fp32,bf16", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [lv["path"] for lv in doc["levels"]] == ["ours", "ours_cbf16"]
    assert all("error" not in lv and lv["streams"] == 2 for lv in doc["levels"])
    bf16 = doc["ours"]["paths"]["ours_cbf16"]
    assert bf16["codec_precision"] == "bf16" and "codec_vs_fp32" not in doc["ours"]["paths"]["ours"]
    # bfloat16 keeps 8 bits of mantissa: the audio moves, by a rounding's worth, not more
    vs = bf16["codec_vs_fp32"]
    assert 0 < vs["max_abs_diff_over_peak"] < 0.25 and 10 < vs["snr_db"] < 80, vs
    assert "codec_vs_fp32" in doc["definitions"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--levels", "8,32"], "must include 1"),
        (["--levels", "1,0"], "at least 1"),
        (["--levels", "1,x"], "cannot read --levels"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--profile-gpu"], "needs --device cuda"),
    ],
)
def test_omnivoice_serving_bench_refuses_bad_levels_before_building(
    monkeypatch, capsys, argv, message
):
    import orchestrate.api.registry as registry

    def no_model(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(registry, "get_family", no_model)
    mod = _ov_bench(monkeypatch)
    assert mod.main(["--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def _ov_bench(monkeypatch):
    import importlib.util
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("ov_serving_bench", bench / "ov_serving_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_omnivoice_level_speaks_the_same_texts_over_its_rounds(monkeypatch, tmp_path):
    """Concurrency 1 once spoke only the shortest text ("Hello there.") while 32 spoke all
    of them: each level now rotates through the same texts round by round, and each batch
    of texts a timed round makes was made once untimed first (its shapes compiled)."""
    from conftest import require_or_skip

    require_or_skip("omnivoice")
    mod = _ov_bench(monkeypatch)
    one = {frozenset(mod.batch_texts(1, r)) for r in range(len(mod.TEXTS))}
    assert set().union(*one) == set(mod.TEXTS)
    assert mod.batch_texts(8, 3) == mod.batch_texts(8, 0) == mod.TEXTS  # one shape a level
    assert mod.batch_texts(10, 1)[8:] == mod.TEXTS[:2]
    family = get_family("omnivoice")
    made: list[tuple[str, ...]] = []
    real = type(family).synthesize_many

    def spy(self, engine, texts, seed, workload):
        made.append(tuple(texts))
        return real(self, engine, texts, seed, workload)

    monkeypatch.setattr(type(family), "synthesize_many", spy)
    out = tmp_path / "ov.json"
    assert (
        mod.main(["--device", "cpu", "--levels", "1,2", "--repeats", "2", "--out", str(out)]) == 0
    )
    warm, timed = made[:4], made[4:]
    assert timed == [tuple(mod.batch_texts(n, r)) for r in range(2) for n in (1, 2)]
    assert set(warm) == set(timed)
    doc = json.loads(out.read_text())
    assert [lv["batches"] for lv in doc["levels"]] == [2, 2]
    assert doc["levels"][0]["vs_concurrency_1"] == 1.0 and "texts" in doc["definitions"]


# ------------------------------------------------------------------ through the runner


def cli_env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _server_fidelity(model, head: str = "codebook") -> object:
    from orchestrate.api.config import load_workload

    params = {"rows": 4, "head": head}
    spec = StackSpec(name="b", techniques=[TechniqueRef(name="batched_decode", params=params)])
    engine = FAMILY.build_engine(model, build_stack(spec, DeviceCaps("cpu"), strict=True))
    return FAMILY.fidelity(model, {"b": engine}, load_workload("serve-smoke"), 24)["b"]


def test_a_servers_fidelity_matches_stock_over_its_own_columns(model):
    """A serving stack's fidelity: its server's step, teacher-forced in a row between two
    rows of other prompts, gives stock's distribution over the codebook's own columns (fp32:
    only summation order differs); the restricted head keeps it approximate, and the
    server's sampler is named as not covered."""
    rec = _server_fidelity(model)
    assert rec.steps == 24 and rec.support_top1 == 1.0 and rec.support_kl < 1e-6
    assert rec.within_tolerance is False  # -inf outside the codebook's columns
    # its sampler (hashed Gumbel top-k, a seed per row) draws stock's sampler's distribution
    assert rec.sampler_tv <= rec.sampler_tv_bound and rec.not_covered == {}


def test_the_audio_heads_server_is_within_stocks_tolerance(model):
    """With `head: audio` every audio unit is a column: the server's teacher-forced logits
    are stock's within the fp32 bar, so only its sampler (another random stream) is left."""
    rec = _server_fidelity(model, head="audio")
    assert rec.within_tolerance and rec.logits_within_tolerance
    assert rec.top1_agreement == 1.0 and rec.mean_kl < 1e-6
    assert rec.sampler_tv <= rec.sampler_tv_bound


@pytest.mark.parametrize(
    "params",
    [{"attention": "triton"}, {"codec_kv": "ring", "codec_attention": "triton"},
     {"codec_precision": "tf32"}],
)  # fmt: skip
def test_a_cuda_only_serving_option_is_refused_on_a_cpu_when_planned(tmp_path, params):
    """A batched_decode option that picks a CUDA kernel or mode is a requirement of the
    technique with those params (Technique.requirements), so planning on a CPU refuses it
    before any model is built: strict, as a technique that cannot run here; otherwise the
    stack has no server left, and the error says why. The defaults need nothing."""
    from orchestrate.api.config import load_workload
    from orchestrate.api.protocol import Protocol
    from orchestrate.api.registry import StackError
    from orchestrate.running.plan import plan_job

    wl, cpu = load_workload("serve-smoke"), ModelSpec(preset="tiny")

    def plan(p: dict, strict: bool):
        ref = TechniqueRef(name="batched_decode", params={"rows": 4} | p)
        stack = StackSpec(name="cuda-only", family="rumik", techniques=[ref])
        return plan_job(cpu, wl, [stack], Protocol(), tmp_path, strict=strict)

    with pytest.raises(StackError, match="'batched_decode' cannot run here: needs a CUDA"):
        plan(params, strict=True)
    with pytest.raises(StackError, match="batched_decode is skipped here: needs a CUDA device"):
        plan(params, strict=False)
    assert plan({}, strict=True).stacks[0].name == "cuda-only"


def test_server_fidelity_sees_a_sampler_that_ignores_top_p(model):
    """Stock's sampler honours top_p; the server's draws top-k only. With top_p 0.5 the
    sampler check measures the difference, and the verdict fails on the sampler alone."""
    from orchestrate.api.config import load_workload

    wl = load_workload("serve-smoke")
    wl = wl.model_copy(update={"sampling": wl.sampling.model_copy(update={"top_p": 0.5})})
    params = {"rows": 4, "head": "audio"}
    spec = StackSpec(name="b", techniques=[TechniqueRef(name="batched_decode", params=params)])
    engine = FAMILY.build_engine(model, build_stack(spec, DeviceCaps("cpu"), strict=True))
    rec = FAMILY.fidelity(model, {"b": engine}, wl, 24)["b"]
    assert rec.logits_within_tolerance and rec.sampler_tv > rec.sampler_tv_bound
    assert not rec.within_tolerance


def test_server_fidelity_sees_a_row_that_reads_its_neighbours(model, monkeypatch):
    from orchestrate.techniques.rumik.batched_decode import BatchedDecoder

    real = BatchedDecoder._forward

    def leaky(self, b, s):  # each row's state mixed with its neighbour's
        hidden = real(self, b, s)
        return hidden + 0.5 * hidden.roll(1, 0)

    monkeypatch.setattr(BatchedDecoder, "_forward", leaky)
    rec = _server_fidelity(model)
    assert rec.support_kl > 1e-3 and rec.support_top1 < 1.0


def test_a_serving_workload_runs_through_the_worker_and_is_stored(tmp_path):
    """`orchestrate run` on a serving workload: the family builds the server from the
    stack's `server` slot, the worker drives the load, and the store keeps per-stream
    figures as `serve.*` metrics; every stream's record is in `<stack>/serving.json`."""
    import json

    from factories import run_cli

    db = f"sqlite:///{tmp_path / 'o.db'}"
    out = run_cli(
        ["run", "--stack", "rumik-batched", "--workload", "serve-smoke", "--db", db,
         "--runs-dir", str(tmp_path / "runs"), "--no-mlflow", "--json"],
        cli_env(), Path.cwd(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)  # the stored run, as `orchestrate show --json` reads it
    (stack,) = run["stacks"]
    m = stack["metrics"]
    assert m["serve.streams"] == 3 and m["serve.incomplete"] == 0
    assert m["serve.served"] + m["serve.behind"] == 3
    assert m["serve.ttfa_p50_s"] > 0 and m["serve.audio_s_per_s"] > 0
    (level,) = (tmp_path / "runs").glob("*/rumik-batched/serving.json")
    doc = json.loads(level.read_text())
    assert doc["load_label"] == "3 concurrent streams"
    assert [s["frames"] for s in doc["per_stream"]] == [4, 4, 4]
    assert "streaming Mimi" in doc["server"]["codec"] and "ttfa_s" in doc["definitions"]
    assert "codec: streaming Mimi" in doc["server"]["phases"]  # each phase defined
    assert doc["phase_ms_per_step"]["step"] > 0 and doc["steps"] > 0
    assert m["serve.phase_ms_per_step.codec"] == doc["phase_ms_per_step"]["codec"]
    fid = stack["fidelity"]  # the server's step teacher-forced against stock's
    assert fid["support_top1"] == 1.0 and fid["not_covered"] == {}
    assert fid["sampler_tv"] <= fid["sampler_tv_bound"]  # its sampler: stock's distribution
    assert stack["exactness"] == "approximate"
    assert not any("exactness unmeasured" in w for w in stack["warnings"])
    memory = doc["memory_bytes"]
    assert memory["cache"] > 0 and 0 < memory["weights_copied"] < memory["weights_read"]
    # measured parked (api/parking.py): this stack reads every model weight, so none left
    assert memory["weights_parked"] == 0 and memory["weights_unread"] == 0
    assert "memory_bytes" in doc["definitions"]
    page = tmp_path / "page.html"  # the run's report page explains the serving columns
    out = run_cli(["report", run["id"], "--db", db, "--out", str(page)], cli_env(), Path.cwd())
    assert out.returncode == 0, out.stderr
    html = page.read_text()
    assert "A serving run: per stack, its streams" in html and "paired headline" not in html
    assert "Where a step goes" in html and "step ms/step" in html and "cache GB" in html
    assert m["serve.memory_bytes.cache"] == memory["cache"]


LOADS = {
    "zero": ("load: {concurrency: 0, frames: 4}", "rumik-batched", "greater than or equal to 1"),
    "rate-no-duration": ("load: {rate: 2.0, frames: 4}", "rumik-batched", "without a duration_s"),
    "beyond-rows": (
        "load: {concurrency: 200, frames: 4}",
        "rumik-batched",
        "200 concurrent streams exceed its 128 cache rows",
    ),
    "single-stream": ("", "rumik-batched", "is single-stream (it has no `load:`)"),
    "no-server": ("load: {concurrency: 2, frames: 4}", "exp74", "no technique that serves many"),
    "sustained-too-short": (  # 4 frames of 80 ms: a window needs 0.64 s of arrivals
        "load: {sustained: 2, duration_s: 0.5, frames: 4}",
        "rumik-batched",
        "has no sustained window: arrivals must last at least twice a stream's 0.32 s",
    ),
    "sustained-beyond-rows": (
        "load: {sustained: 200, duration_s: 10, frames: 4}",
        "rumik-batched",
        "a sustained 200 live streams exceed its 128 cache rows",
    ),
    "sustained-and-rate": (
        "load: {sustained: 2, rate: 3.0, duration_s: 10, frames: 4}",
        "rumik-batched",
        "not rate and sustained",
    ),
    "top-p": (
        "load: {concurrency: 2, frames: 4}\nsampling: {top_p: 0.9}",
        "rumik-batched",
        "top_p 0.9 is not implemented",
    ),
}


@pytest.mark.parametrize("case", sorted(LOADS))
def test_bad_serving_input_is_one_line_and_exit_2_before_any_model(tmp_path, case):
    """A concurrency of zero or beyond the cache's rows, a rate without a duration, a
    batched technique on a single-stream workload, a serving workload on a stack that
    cannot serve: one line each, exit 2, nothing built (no worker ran: no runs folder)."""
    from factories import run_cli

    load, stack, message = LOADS[case]
    (tmp_path / "wl.yaml").write_text(
        "name: wl\nprompts:\n- {id: a1, text: A short line to speak.}\n" + load + "\n"
    )
    out = run_cli(
        ["run", "--stack", stack, "--workload", str(tmp_path / "wl.yaml"),
         "--db", f"sqlite:///{tmp_path / 'o.db'}", "--runs-dir", str(tmp_path / "runs"),
         "--no-mlflow"],
        cli_env(), tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "command",
    [["noise"], ["gate", "--stack", "exp74"], ["explore", "--from", "stock"]],
    ids=["noise", "gate", "explore"],
)
def test_per_utterance_commands_refuse_a_serving_workload(tmp_path, command):
    """Noise, gates and explorations compare per-utterance speed; a serving workload has
    none to compare: refused by name, exit 2, nothing stored."""
    from factories import run_cli

    db = tmp_path / "o.db"
    out = run_cli(
        [*command, "--workload", "serve-smoke", "--db", f"sqlite:///{db}"], cli_env(), tmp_path
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert f"`orchestrate {command[0]}` compares per-utterance speed" in out.stderr
    assert "serving workload (3 concurrent streams)" in out.stderr
    assert not db.exists()


def test_explorations_are_not_offered_the_serving_technique():
    """Proposers read this catalogue; a batched_decode candidate on a single-stream workload
    would only be refused at planning."""
    from orchestrate.explore.state import technique_catalogue

    offered = technique_catalogue("rumik")
    assert "batched_decode" not in offered and "graph_loop" in offered


@pytest.mark.parametrize("codec_kv", [None, "ring"])
def test_the_stacks_codec_window_reaches_the_servers_codec(model, codec_kv):
    """batched_decode's codec_kv (version 7) is how the server's Mimi stream keeps its
    window; left out, the gathered window of versions before it."""
    params = {"rows": 2} | ({"codec_kv": codec_kv} if codec_kv else {})
    spec = StackSpec(
        name="kv", family="rumik", techniques=[TechniqueRef(name="batched_decode", params=params)]
    )
    engine = FAMILY.build_engine(model, build_stack(spec))
    server = engine.server(engine, 64, SamplingConfig(top_k=1), 1, rows=2)
    assert server.codec.stream.kv == (codec_kv or "gather")


def test_the_stacks_prefill_chunks_and_pipeline_reach_the_server(model):
    """batched_decode's chunk_tokens needs glue triton and pipeline needs codec overlap
    (refused when the stack is read); a pipelined stack's server is pipelined."""
    from orchestrate.api.registry import StackError

    def spec(**params) -> StackSpec:
        ref = TechniqueRef(name="batched_decode", params={"rows": 2, **params})
        return StackSpec(name="serving-options", family="rumik", techniques=[ref])

    with pytest.raises(StackError, match="chunk_tokens needs glue 'triton'"):
        build_stack(spec(chunk_tokens=64))
    with pytest.raises(StackError, match="pipeline needs codec 'overlap'"):
        build_stack(spec(pipeline=True))
    engine = FAMILY.build_engine(model, build_stack(spec(pipeline=True, codec="overlap")))
    server = engine.server(engine, 64, SamplingConfig(top_k=1), 1, rows=2)
    assert server.pipeline and server.overlap and not server.dec.chunk_tokens


def test_the_codecs_ring_kernel_needs_the_ring_and_a_gpu(model):
    """codec_attention triton reads ring slots in place: refused with the gathered window
    when the stack is read, and on the CPU when it is applied (the kernel's own tests run it
    in Triton's interpreter, tests/test_kernels.py)."""
    from orchestrate.api.registry import StackError
    from orchestrate.api.technique import Refused

    def spec(**params) -> StackSpec:
        ref = TechniqueRef(name="batched_decode", params={"rows": 2, **params})
        return StackSpec(name="codec-kernel", family="rumik", techniques=[ref])

    with pytest.raises(StackError, match="codec_attention 'triton' reads ring slots"):
        build_stack(spec(codec_attention="triton"))
    built = build_stack(spec(codec_attention="triton", codec_kv="ring"))
    with pytest.raises(Refused, match="codec_attention 'triton' needs a CUDA device"):
        FAMILY.build_engine(model, built)
