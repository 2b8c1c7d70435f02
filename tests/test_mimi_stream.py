"""Mimi's decoder streamed chunk by chunk (families/rumik/mimi_stream.py) against the whole-
sequence decode of the same codes: rows advanced in different groupings and chunk sizes,
a window shorter than the stream, a slot reused by a new stream, the real Mimi shape."""

from __future__ import annotations

import pytest
import torch
from transformers import MimiConfig, MimiModel

from orchestrate.api.family import seed_codebooks
from orchestrate.families.rumik.mimi_stream import MimiStream, StreamRefused
from orchestrate.families.rumik.presets import TINY


def codec(**config) -> MimiModel:
    torch.manual_seed(0)
    model = MimiModel(MimiConfig(**config)).eval()
    seed_codebooks(model)
    return model


def whole(model: MimiModel, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.decode(codes).audio_values


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 rounding, relative to the audio's scale."""
    return got.shape == want.shape and bool((got - want).abs().max() <= 1e-5 * want.abs().max())


# (stream indices, frames) per decode call: every stream ends at 20 frames, reached in
# different chunkings, streams at different positions decoded in one call.
PLAN = [
    ([0, 1, 2], 2),
    ([0], 3),
    ([1, 2], 3),
    ([0, 1, 2], 1),
    ([2], 6),
    ([0, 1], 6),
    ([0, 1, 2], 8),
]


# How the transformer's window is kept: gathered and written back, or ring slots (whose
# decodes longer than max_frames run as pieces: 1 splits every chunk, 4 the longer ones).
LAYOUTS = pytest.mark.parametrize(
    "kv, max_frames", [("gather", 4), ("ring", 4), ("ring", 1)], ids=["gather", "ring", "ring-1"]
)


@LAYOUTS
@pytest.mark.parametrize("window", [6, 250], ids=["window-6-positions", "window-250"])
def test_chunks_in_any_grouping_give_the_whole_decode(window, kv, max_frames):
    """A 6-position window (3 frames) is far shorter than the 20-frame streams: the carried
    keys and values must slide, and every query sees only its own row's window."""
    model = codec(**{**TINY.mimi, "sliding_window": window})
    codes = torch.randint(0, model.config.codebook_size, (3, model.config.num_quantizers, 20))
    slots = [1, 3, 0]  # stream i lives in slot slots[i] of 4
    stream = MimiStream(model, rows=4, kv=kv, max_frames=max_frames)
    chunks: list[list[torch.Tensor]] = [[], [], []]
    done = [0, 0, 0]
    for streams, n in PLAN:
        batch = torch.stack([codes[i, :, done[i] : done[i] + n] for i in streams])
        audio = stream.decode(torch.tensor([slots[i] for i in streams]), batch)
        for j, i in enumerate(streams):
            chunks[i].append(audio[j])
            done[i] += n
    got = torch.stack([torch.cat(c, dim=-1) for c in chunks])
    assert close(got, whole(model, codes))
    # The naive way, each chunk decoded on its own, is not close: the check can fail.
    naive = torch.cat([whole(model, codes[:, :, i : i + 2]) for i in range(0, 20, 2)], dim=-1)
    assert not close(naive, whole(model, codes))


@LAYOUTS
def test_a_reset_slot_starts_a_new_stream(kv, max_frames):
    model = codec(**{**TINY.mimi, "sliding_window": 6})
    first, second = (torch.randint(0, 64, (1, 8, 10)) for _ in range(2))
    stream = MimiStream(model, rows=2, kv=kv, max_frames=max_frames)
    slot = torch.tensor([1])
    stream.decode(slot, first[..., :7])
    stream.reset(slot)
    got = torch.cat(
        [stream.decode(slot, second[..., :4]), stream.decode(slot, second[..., 4:])], -1
    )
    assert close(got, whole(model, second))
    stream.decode(slot, first[..., :3])  # without a reset, the old stream's state leaks in
    assert not close(stream.decode(slot, second[..., :4]), whole(model, second[..., :4]))


@LAYOUTS
def test_the_real_mimi_shape_streams_exactly(kv, max_frames):
    """The released Mimi configuration (8 codebooks of 2048, 512-wide transformer, SEANet
    ratios 8, 6, 5, 4): 1920 samples a frame."""
    model = codec(num_quantizers=8)
    codes = torch.randint(0, 2048, (2, 8, 5))
    stream = MimiStream(model, rows=2, kv=kv, max_frames=max_frames)
    rows = torch.tensor([0, 1])
    got = torch.cat([stream.decode(rows, codes[..., :2]), stream.decode(rows, codes[..., 2:])], -1)
    assert got.shape[-1] == 5 * 1920
    assert close(got, whole(model, codes))


def test_the_ring_holds_fewer_slots_than_a_window_cannot_pass_unnoticed():
    """The ring must hold every key a chunk's queries see: with the slots of the window
    alone (too few by a chunk's positions), 2-frame chunks lose keys and the audio is off."""
    model = codec(**{**TINY.mimi, "sliding_window": 6})
    codes = torch.randint(0, 64, (1, 8, 12))
    stream = MimiStream(model, rows=1, kv="ring", max_frames=2)
    short = stream.window  # what the ring would be without room for the chunk's positions
    stream.slot_position = stream.slot_position[:, :short].clone()
    stream.keys = [k[:, :, :short].clone() for k in stream.keys]
    stream.values = [v[:, :, :short].clone() for v in stream.values]
    slot = torch.tensor([0])
    got = torch.cat([stream.decode(slot, codes[..., i : i + 2]) for i in range(0, 12, 2)], -1)
    assert not close(got, whole(model, codes))


def test_an_unknown_kv_layout_is_refused():
    with pytest.raises(ValueError, match="kv 'paged': one of gather, ring"):
        MimiStream(codec(**TINY.mimi), rows=1, kv="paged")


def test_a_padding_it_cannot_stream_is_refused():
    with pytest.raises(StreamRefused, match="pad_mode 'reflect'"):
        MimiStream(codec(**{**TINY.mimi, "pad_mode": "reflect"}), rows=1)


@pytest.mark.parametrize(
    "b, c, t, k, stride",
    [(3, 8, 1, 4, 2), (2, 5, 7, 4, 2), (1, 3, 4, 3, 2), (2, 4, 3, 6, 3), (2, 4, 5, 2, 2)],
)
def test_the_depthwise_transposed_convolution_is_torchs(b, c, t, k, stride):
    """Mimi's upsample (groups = channels) as multiply-adds into strided slices: the same
    output as torch's grouped transposed convolution, overlapping kernels (k > stride), a
    kernel not a multiple of the stride, and none overlapping (k = stride) included."""
    from torch.nn import functional as F

    from orchestrate.families.rumik.mimi_stream import depthwise_transposed

    torch.manual_seed(k * 10 + t)
    x, w = torch.randn(b, c, t), torch.randn(c, 1, k)
    want = F.conv_transpose1d(x, w, None, stride, 0, 0, c, 1)
    got = depthwise_transposed(x, w, stride)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6, rtol=1e-6)


def test_the_stream_upsamples_without_a_grouped_transposed_convolution(monkeypatch):
    """The streamed decode takes the multiply-add path for Mimi's depthwise upsample (cuDNN's
    grouped engine is slow on a GPU) and torch's for SEANet's ungrouped ones."""
    import orchestrate.families.rumik.mimi_stream as ms

    groups: list[int] = []
    real = ms.F.conv_transpose1d

    def spy(x, w, bias, stride, padding, output_padding, g, dilation):
        groups.append(g)
        return real(x, w, bias, stride, padding, output_padding, g, dilation)

    monkeypatch.setattr(ms.F, "conv_transpose1d", spy)
    model = codec(**TINY.mimi)
    codes = torch.randint(0, model.config.codebook_size, (2, model.config.num_quantizers, 3))
    MimiStream(model, rows=2).decode(torch.tensor([0, 1]), codes)
    assert groups and set(groups) == {1}  # SEANet's, ungrouped; the upsample went the other way
