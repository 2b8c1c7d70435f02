"""Mimi's decoder run chunk by chunk, its state carried per stream, so that the audio of a
stream decoded a few frames at a time is the audio of decoding all its frames at once.

transformers' `MimiModel.decode` takes a whole code sequence (its encoder has a streaming
padding cache; its decoder does not), and decoding each chunk on its own restarts every
causal convolution from zeros and the transformer from position 0: wrong audio at each
chunk edge. A streaming server needs each row's chunk decoded as it completes, rows at
different points of their streams decoded together. What each stage carries per row:

  quantizer      nothing (each frame's codes decode to its latent alone);
  upsample       the transposed convolution's tail: its last kernel - stride output samples,
                 which the next chunk's first samples overlap (the whole decode trims them
                 off the end, so they are never emitted early);
  transformer    each layer's keys and values of the row's last `sliding_window` positions
                 and the row's position (rows at different positions step together: each
                 query attends to its own row's window, a per-row mask);
  SEANet         each causal stride-1 convolution's last (kernel - 1) * dilation inputs, and
                 each transposed convolution's tail, as above.

State lives in tensors with one row per stream slot (`rows`), and one more, `scratch`, that
no stream owns (a padded batch's filler rows step it), so a batch of any rows is gathered,
stepped and scattered back. `reset(rows)` starts new streams in those slots.
Exactness against the whole-sequence decode is measured (tests/test_mimi_stream.py), not
assumed: the same weights, float rounding apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

KV_LAYOUTS = ("gather", "ring")  # how the transformer's window is kept (MimiStream._transformer)
# (q [b, H, t, D], keys, values [rows + 1, Hkv, slots, D], rows [b], slot_position
# [rows + 1, slots], q_position [b, t], window, scale) -> [b, H, t, D]: the ring's attention
# read in place (techniques/rumik/kernels/ring_attention.py has the contract)
RingAttention = Callable[..., torch.Tensor]


class StreamRefused(ValueError):
    """A codec layout this streaming decoder cannot reproduce exactly (it says which part)."""


def decoder_parts(codec: Any) -> tuple[nn.Module | None, nn.Module, nn.Module]:
    """(upsample, transformer, SEANet decoder) of a transformers MimiModel: recent releases
    keep them in a MimiDecoderModel at `codec.decoder`, earlier ones on the model itself."""
    inner = getattr(codec, "decoder", None)
    if inner is not None and hasattr(inner, "decoder_seanet"):
        return inner.upsample, inner.decoder_transformer, inner.decoder_seanet
    if hasattr(codec, "decoder_transformer"):
        return getattr(codec, "upsample", None), codec.decoder_transformer, codec.decoder
    raise StreamRefused(f"{type(codec).__name__}: no Mimi decoder layout this module knows")


def depthwise_transposed(x: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """conv_transpose1d of x [b, C, t] by a depthwise weight [C, 1, k] (groups = C; no bias,
    padding or dilation), as k multiply-adds of x into strided slices of the output: sample
    stride * i + j gets x[i] * w[j]. cuDNN runs the grouped transposed convolution as a
    generic engine (Mimi's upsample: 1.9 ms a call for ~30 rows of one frame on an H100,
    benchmarks/h100/serving/serving-gpu-profile.json); this is a handful of tiny kernels.
    The same products; where two overlap, summed in ascending j (cuDNN's order may differ:
    float rounding apart)."""
    b, c, t = x.shape
    k = weight.shape[-1]
    y = x.new_zeros(b, c, (t - 1) * stride + k)
    for j in range(k):
        y[..., j : j + (t - 1) * stride + 1 : stride].addcmul_(x, weight[:, 0, j, None])
    return y


def _kind(module: nn.Module) -> str:
    return type(module).__name__


class MimiStream:
    """Streaming decode of `codec` for `rows` stream slots (see the module docstring)."""

    def __init__(
        self,
        codec: Any,
        rows: int,
        kv: str = "gather",
        max_frames: int = 4,
        ring_attention: RingAttention | None = None,
    ) -> None:
        if kv not in KV_LAYOUTS:
            raise ValueError(f"kv {kv!r}: one of {', '.join(KV_LAYOUTS)}")
        if ring_attention is not None and kv != "ring":
            raise ValueError(f"a ring attention reads ring slots: kv 'ring', not {kv!r}")
        self.codec, self.rows, self.kv = codec, rows, kv
        # None: the ring gathered per decode and a masked SDPA over it
        self.ring_attention = ring_attention
        self.scratch = rows  # the state row padding rows read and write
        self.upsample, self.transformer, self.seanet = decoder_parts(codec)
        cfg = self.transformer.config
        if getattr(cfg, "pad_mode", "constant") != "constant":
            raise StreamRefused(f"pad_mode {cfg.pad_mode!r}: only zero padding streams exactly")
        self.window = int(cfg.sliding_window)
        # Transformer positions per codec frame (Mimi's upsample doubles its 12.5 Hz frames).
        per_frame = int(self.upsample.conv.stride[0]) if self.upsample is not None else 1
        self.max_frames = max_frames  # ring: a longer decode runs as pieces of this many
        ring = self.window + per_frame * max_frames  # every key a chunk's queries can see
        slots = self.window if kv == "gather" else ring
        param = next(codec.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.state: dict[int, torch.Tensor] = {}  # id(conv module) -> [rows, C, carried]
        for conv in self._stateful():
            self.state[id(conv)] = self._zeros(*self._carried(conv))
        attn = self.transformer.layers[0].self_attn
        shape = (rows + 1, attn.num_key_value_heads, slots, attn.head_dim)
        n = len(self.transformer.layers)
        self.keys = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(n)]
        self.values = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(n)]
        self.position = torch.zeros(rows + 1, dtype=torch.long, device=self.device)
        # ring only: the position each slot's key is of (-1: none yet)
        self.slot_position = (
            torch.full((rows + 1, slots), -1, device=self.device) if kv == "ring" else None
        )

    # ------------------------------------------------------------------ state

    def _stateful(self) -> list[nn.Module]:
        convs = [
            m for m in self.seanet.modules() if _kind(m) in ("MimiConv1d", "MimiConvTranspose1d")
        ]
        return ([self.upsample] if self.upsample is not None else []) + convs

    def _carried(self, conv: nn.Module) -> tuple[int, int]:
        """(channels, samples) a stream carries across chunks for this convolution."""
        inner: nn.Conv1d | nn.ConvTranspose1d = conv.conv
        if _kind(conv) == "MimiConvTranspose1d":
            if not conv.causal or conv.padding_left != 0:
                raise StreamRefused("a non-causal transposed convolution does not stream")
            return inner.out_channels, inner.kernel_size[0] - inner.stride[0]
        if not conv.causal or inner.stride[0] != 1:
            raise StreamRefused("only causal stride-1 convolutions stream in the decoder")
        return inner.in_channels, int(conv.padding_total)

    def _zeros(self, channels: int, samples: int) -> torch.Tensor:
        shape = (self.rows + 1, channels, samples)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def reset(self, rows: torch.Tensor) -> None:
        """Start new streams in these slots: zero history, position 0."""
        rows = rows.to(self.device)  # index_fill_: `buf[rows] = 0` would sync the stream
        for buf in (*self.state.values(), *self.keys, *self.values):
            buf.index_fill_(0, rows, 0)
        self.position.index_fill_(0, rows, 0)
        if self.slot_position is not None:
            self.slot_position.index_fill_(0, rows, -1)

    # ------------------------------------------------------------------ decode

    @torch.inference_mode()
    def decode(self, rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The next `codes.shape[-1]` frames of each row's stream: [b, channels, samples].
        `rows` are the b slots, `codes` [b, codebooks, frames] their codes."""
        rows = rows.to(self.device)
        if self.kv == "ring" and codes.shape[-1] > self.max_frames:  # streamed: exact
            pieces = codes.split(self.max_frames, dim=-1)
            return torch.cat([self.decode(rows, piece) for piece in pieces], dim=-1)
        x = self.codec.quantizer.decode(codes.to(self.device))
        if self.upsample is not None:
            x = self._transposed(self.upsample, rows, x)
        x = self._transformer(rows, x.transpose(1, 2)).transpose(1, 2)
        return self._seanet(rows, x)

    def _conv(self, conv: nn.Module, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        buf = self.state[id(conv)]
        if buf.shape[-1]:
            x = torch.cat([buf[rows], x], dim=2)
            buf[rows] = x[..., -buf.shape[-1] :]
        return conv.conv(x)

    def _transposed(self, conv: nn.Module, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        inner: nn.ConvTranspose1d = conv.conv
        if inner.groups == inner.in_channels == inner.out_channels and inner.dilation[0] == 1:
            y = depthwise_transposed(x, inner.weight, inner.stride[0])
        else:
            y = F.conv_transpose1d(
                x, inner.weight, None, inner.stride, 0, 0, inner.groups, inner.dilation
            )
        buf = self.state[id(conv)]
        tail = buf.shape[-1]
        if tail:
            y[..., :tail] += buf[rows]
        keep = x.shape[-1] * inner.stride[0]
        buf[rows] = y[..., keep:]  # bias-free: the overlap gets the bias once, when emitted
        y = y[..., :keep]
        return y if inner.bias is None else y + inner.bias[:, None]

    def _seanet(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for layer in self.seanet.layers:
            kind = _kind(layer)
            if kind == "MimiConv1d":
                x = self._conv(layer, rows, x)
            elif kind == "MimiConvTranspose1d":
                x = self._transposed(layer, rows, x)
            elif kind == "MimiResnetBlock":
                residual = x
                for sub in layer.block:
                    x = self._conv(sub, rows, x) if _kind(sub) == "MimiConv1d" else sub(x)
                shortcut = layer.shortcut
                residual = (
                    self._conv(shortcut, rows, residual)
                    if _kind(shortcut) == "MimiConv1d"
                    else shortcut(residual)
                )
                x = residual + x
            elif isinstance(layer, nn.ELU | nn.Identity):
                x = layer(x)
            else:  # a layer whose state this decoder would not carry: refuse, never guess
                raise StreamRefused(f"SEANet layer {kind} has no streaming rule")
        return x

    def _transformer(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Each layer's attention over the row's window. `gather`: the window's keys and
        values are gathered, the chunk's appended, and the last `window` written back (three
        passes over the window a layer). `ring`: the chunk's keys and values go into ring
        slots (position % slots), and attention reads the row's ring once, a slot masked by
        the position it holds: gathered for a masked SDPA, or read in place by
        `ring_attention` (a kernel). The same keys every way; the softmax sums in another
        order."""
        from transformers.models.mimi.modeling_mimi import apply_rotary_pos_emb

        b, t, _ = x.shape
        start = self.position[rows]
        pos = start[:, None] + torch.arange(t, device=self.device)[None, :]  # [b, t]
        cos, sin = self.transformer.rotary_emb(x, pos)
        if self.slot_position is not None:  # ring
            slot = pos % self.slot_position.shape[1]  # [b, t]
            self.slot_position[rows[:, None], slot] = pos
            key_pos = self.slot_position[rows] if self.ring_attention is None else None
        else:  # cached slot j of a row holds position start - window + j (< 0: none yet)
            cached = start[:, None] - self.window + torch.arange(self.window, device=self.device)
            key_pos = torch.cat([cached, pos], dim=1)  # [b, window + t]
        if key_pos is not None:  # the mask of the gathered window's SDPA
            gap = pos[:, :, None] - key_pos[:, None, :]
            mask = (key_pos[:, None, :] >= 0) & (gap >= 0) & (gap < self.window)
        for i, layer in enumerate(self.transformer.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            shape = (b, t, -1, attn.head_dim)
            q = attn.q_proj(h).view(shape).transpose(1, 2)
            k = attn.k_proj(h).view(shape).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if self.kv == "ring":  # [b, t] slots <- [b, t, heads, dim]
                self.keys[i][rows[:, None], :, slot] = k.transpose(1, 2)
                self.values[i][rows[:, None], :, slot] = v.transpose(1, 2)
            if self.ring_attention is not None:  # each row's ring read in place
                out = self.ring_attention(
                    q, self.keys[i], self.values[i], rows, self.slot_position, pos,
                    self.window, attn.scaling,
                )  # fmt: skip
            else:
                if self.kv == "ring":
                    keys, values = self.keys[i][rows], self.values[i][rows]
                else:
                    keys = torch.cat([self.keys[i][rows], k], dim=2)
                    values = torch.cat([self.values[i][rows], v], dim=2)
                    self.keys[i][rows] = keys[:, :, -self.window :]
                    self.values[i][rows] = values[:, :, -self.window :]
                groups = attn.num_heads // attn.num_key_value_heads
                if groups > 1:
                    keys = keys.repeat_interleave(groups, dim=1)
                    values = values.repeat_interleave(groups, dim=1)
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask[:, None], scale=attn.scaling
                )
            out = attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.self_attn_layer_scale(out)
            x = x + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(x)))
        self.position[rows] = start + t
        return x
