"""Batched decode for serving many Rumik streams: one decode step over many rows, gpt-fast
style (issue 34).

A static KV cache holds one row per stream ([layers, rows, kv heads, positions, head dim]);
every row carries its own position, token count, seed and stop rules in device buffers, so
the step has fixed shapes per (batch bucket, context bucket) and can be captured in a CUDA
graph and replayed. One step, for the first `b` rows, over the first `s` cache positions:

  ids[b] -> embedding -> 36 x (LN -> packed q,k,v,gate,up -> rotary on sliding layers ->
  write k,v at each row's position -> attention over that row's filled positions -> x +
  o(attn) + down(act), accumulated) -> final LN -> stop head -> the row's codebook head
  (step % 8) -> seeded top-k sample -> ids, positions, counts advance on the rows still generating.

Attention (`attention=`): "sdpa", SDPA over the bucket's first `s` positions with a
per-row boolean mask (plain PyTorch; any device), or "triton", the batched decode-attention
kernel (kernels/batched_attention.py: each row reads only its own filled positions; CUDA,
head_dim 128). Both compute the same softmax over the same positions; the sums run in
another order.

Prefill writes a new request's prompt (all but its last token) into a free row while the
other rows keep their state; the next step then reads the last prompt token and samples the
first audio token, so prefill needs no head of its own. Two ways: `write_prompts`, a pass
of its own over the prompts (every weight read again), or, with glue 'triton' and
`chunk_tokens`, chunked prefill: up to that many prompt tokens ride along a decode step as
extra rows of its projections, each written into its stream's cache row at its own
position by the rotary kernel and attending over that row's positions up to its own by the
attention kernel (their row maps; the layer's keys are all written before it attends, so a
chunk's tokens see each other causally). A held row (`hold`) is being prefilled: its own
step query sits at position -1, writing nothing and reading nothing.

The sampler draws with the Gumbel-max trick, its noise a hash of (row seed, token index,
column): a row's tokens depend on its own seed and logits only, never on which other rows
share the batch, so a row at batch N draws what it draws alone. Top-k = 1 is greedy.
Same distribution as stock's top-k sampling (temperature, k over the allowed columns), a
different random stream (like device_sampler). The codebook head is codebook_head's
(APPROXIMATE: restricted to codebook step % 8 per row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from orchestrate.api.config import SamplingConfig
from orchestrate.api.device import to_device_async
from orchestrate.families.rumik.engine import Projections, layer_norm, stock_engine, tensor_bytes
from orchestrate.families.rumik.model import RumikModel
from orchestrate.techniques.rumik.audio_head import AudioRowsHead
from orchestrate.techniques.rumik.codebook_head import CurrentCodebookHead
from orchestrate.techniques.rumik.fp8_projections import FP8, quantize_activations, quantize_rows
from orchestrate.techniques.rumik.kernels.int4_cache import quantize_int4
from orchestrate.techniques.rumik.packed_projections import Packed
from orchestrate.techniques.rumik.static_kv_cache import rotate_half_pairs

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values below 2**32 (products wrap
    in int64; the mask keeps their low 32 bits, which are exact)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Gumbel(0,1) noise per (row seed [b], row token index [b], column [b, k]) -> [b, k]."""
    h = _fmix32((seed[:, None] * 0x9E3779B1 + step[:, None]) & _M32)
    h = _fmix32(h ^ ((cols * 0x85EBCA77 + 0x27D4EB2F) & _M32))
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # 24 random bits: uniform in (0, 1)
    return -torch.log(-torch.log(u))


ATTENTION = ("sdpa", "triton")
# the cache in the model's dtype, e4m3 with a scale per vector, or packed INT4 with one
# (kernels/int4_cache.py: two values a byte, half the fp8 cache's bytes; APPROXIMATE)
KV = ("model", "fp8", "int4")
HEADS = ("codebook", "audio")
# The step's work between its projections and attention: eager torch ops, or the Triton
# kernels of kernels/rope_norm.py and kernels/swiglu.py (CUDA, or TRITON_INTERPRET=1).
GLUE = ("torch", "triton")
# BatchedDecoder.splits: launches of fewer attention programs than SPLIT_BELOW split their
# rows' positions until there are about SPLIT_PROGRAMS (an H100 or H200 has 132 SMs). On
# an H100, one row's all-approximate step went from 2.414 to 2.212 ms and four rows' from
# 3.580 to 3.464; at 64 programs (16 rows) splitting was 1% slower (3.678 against 3.638:
# benchmarks/h100/serving/batched-step-splits.json), so those are left whole.
SPLIT_BELOW = 64
SPLIT_PROGRAMS = 128
ATTENTION_BLOCKS = (32, 64, 128)  # BatchedDecoder's attention_block: positions a block
# Its default over a bf16 or fp8 cache. 128 read the served rows' caches fastest of 36
# launch options at 256, 448 and 512 rows on an H100 (1.07-1.09x the 64 before it) and
# served 556 of 1,121 streams against 64's 483 at 448 live in one run
# (benchmarks/h100/serving/batched-attention-sweep-448.json, serving-ab-attention-block.json).
ATTENTION_BLOCK = 128
# Over a float32 cache: 128-position blocks of keys and values asked an H100 for 272 KiB of
# shared memory, past its 227 KiB (benchmarks/h100/serving/kernel-tests-block128-fp32.log).
ATTENTION_BLOCK_FP32 = 64


class BatchedDecoder:
    """The B-row cache, the per-row state buffers and the decode step over a bucket."""

    @torch.no_grad()  # packed copies of the weights need no autograd history
    def __init__(
        self,
        model: RumikModel,
        rows: int,
        max_seq_len: int,
        sampling: SamplingConfig,
        attention: str = "sdpa",
        head: str = "codebook",
        projections: Projections | None = None,
        kv: str = "model",
        glue: str = "torch",
        chunk_tokens: int = 0,
        attention_block: int | None = None,  # None: ATTENTION_BLOCK, or _FP32 for its cache
        attention_splits: int | str = "auto",
    ):
        lm, cfg = model.lm, model.config
        self.attention = _attention(attention, model)
        if attention_splits != "auto" and not (
            type(attention_splits) is int and attention_splits == 1
        ):
            raise ValueError(f"attention_splits {attention_splits!r}: 'auto' or 1")
        if attention_block is not None and attention_block not in ATTENTION_BLOCKS:
            raise ValueError(f"attention_block {attention_block}: one of {ATTENTION_BLOCKS}")
        if attention_block not in (None, ATTENTION_BLOCK) and self.attention is None:
            raise ValueError("attention_block is the kernel's: it needs attention 'triton'")
        if kv not in KV:
            raise ValueError(f"kv {kv!r}: one of {', '.join(KV)}")
        if kv != "model" and self.attention is None:
            raise ValueError(f"kv {kv!r} needs attention 'triton' (its kernel reads the scales)")
        if why := glue_refusal(glue, attention):
            raise ValueError(why)
        if chunk_tokens < 0 or (chunk_tokens and glue != "triton"):
            raise ValueError(
                f"chunk_tokens {chunk_tokens}: 0 (prompts written apart), or positive with "
                "glue 'triton' (the row maps of its rotary and attention kernels)"
            )
        self.kv, self.glue = kv, glue
        self.kv_scaled = kv != "model"  # a quantized cache: a float32 scale per vector
        dev, dt = lm.device, lm.dtype
        self.model, self.rows, self.capacity, self.sampling = model, rows, max_seq_len, sampling
        # q,k,v,gate,up: the model's own packed tensor; o and down: its own weights, summed
        # into the residual by `_residual` (no copy of either: the cache gets the room).
        # `projections`: a technique's that serves many rows (fp8_projections) instead.
        self.own_proj = projections is None
        self.proj = projections or Packed(stock_engine(model), fuse_output=False)
        # codebook: per row, the rows of codebook (count % 8) + end (APPROXIMATE); audio:
        # every audio unit + end, stock's distribution. Both compute the same matmul (all
        # 8 codebooks' rows); they differ in the columns a row samples from.
        if head not in HEADS:
            raise ValueError(f"head {head!r}: one of {', '.join(HEADS)}")
        self.head_kind = head
        if head == "codebook":
            self.head = CurrentCodebookHead(model)
            self.head_w = self.head.weight.flatten(0, 1)  # [8 * C, H]: every codebook at once
            self.columns = self.head.weight.shape[1]  # C = codebook units + end-of-audio
        else:
            self.head = AudioRowsHead(model)
            self.head_w = self.head.weight  # [units + 1, H]
            self.columns = self.head.weight.shape[0]
        self.embed = lm.model.embed_tokens.weight
        self.norms = [layer.input_layernorm.weight for layer in lm.model.layers]
        self.final_norm, self.eps = lm.model.norm.weight, cfg.layer_norm_eps
        self.sliding = [t == "sliding_attention" for t in cfg.layer_types]
        self.window = cfg.sliding_window
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # One row more than the streams': `scratch`, where padded prefill rows write.
        self.scratch = rows
        shape = (len(self.norms), rows + 1, self.hkv, max_seq_len, self.d)
        cache_dt = {"fp8": FP8, "int4": torch.uint8}.get(kv, dt)
        wide = cache_dt.itemsize > 2
        if attention_block is None:
            attention_block = ATTENTION_BLOCK_FP32 if wide else ATTENTION_BLOCK
        elif attention_block > ATTENTION_BLOCK_FP32 and wide and self.attention is not None:
            raise ValueError(
                f"attention_block {attention_block} over a {cache_dt} cache: more shared memory "
                f"than an H100 has; {ATTENTION_BLOCK_FP32} or less, or a bf16 or fp8 cache"
            )
        packed = (*shape[:-1], self.d // 2) if kv == "int4" else shape  # two values a byte
        self.k = torch.zeros(packed, dtype=cache_dt, device=dev)
        self.v = torch.zeros(packed, dtype=cache_dt, device=dev)
        # fp8, int4: each position's key and value vector (per kv head) with its own scale
        scale_shape = shape[:-1] if self.kv_scaled else (0,)
        self.k_scale = torch.zeros(scale_shape, dtype=torch.float32, device=dev)
        self.v_scale = torch.zeros(scale_shape, dtype=torch.float32, device=dev)
        inv_freq = lm.model.rotary_emb.inv_freq.float().to(dev)
        angles = torch.outer(torch.arange(max_seq_len, device=dev).float(), inv_freq)
        angles = torch.repeat_interleave(angles, 2, dim=-1)  # interleaved, as Cohere2
        self.cos, self.sin = angles.cos().to(dt), angles.sin().to(dt)
        # glue triton's tables: one value per interleaved pair (the same rounded values)
        self.cos_pairs = self.cos[:, ::2].contiguous()
        self.sin_pairs = self.sin[:, ::2].contiguous()
        self.kv_index = torch.arange(max_seq_len, device=dev)
        self.row_index = torch.arange(rows, device=dev)
        # Per-row state, read and advanced by the step on the device (graph-safe).
        long = dict(dtype=torch.long, device=dev)
        self.ids = torch.zeros(rows, **long)  # the token each row feeds next
        self.pos = torch.zeros(rows, **long)  # its cache position
        self.count = torch.zeros(rows, **long)  # audio tokens it has sampled
        self.seed = torch.zeros(rows, **long)
        self.active = torch.zeros(rows, **long)  # 1 while the row generates
        self.allow_end = torch.zeros(rows, dtype=torch.bool, device=dev)  # length policy 'model'
        self.out = torch.zeros(rows, **long)  # the token id each row sampled this step
        # The attention kernel runs rows x kv heads programs: a few rows leave most SMs
        # idle, reading long ranges one block after another. "auto" then splits each row's
        # positions across programs and merges them (the same softmax, summed in another
        # order: `splits`); 1 never splits.
        self.attention_splits: int | str = attention_splits
        # Positions a program reads per block when a launch is not split (ATTENTION_BLOCK
        # says why 128). The same softmax, summed in blocks of another size.
        self.attention_block = attention_block
        # Chunked prefill: the prompt tokens a step carries, each (cache row, position, id);
        # padding tokens write position 0 of `scratch`.
        self.chunk_tokens = chunk_tokens
        self.chunk_rows = torch.full((chunk_tokens,), self.scratch, **long)
        self.chunk_pos = torch.zeros(chunk_tokens, **long)
        self.chunk_ids = torch.zeros(chunk_tokens, **long)
        self.stop_from = sampling.min_tokens_before_stop

    def _reads(self) -> list[torch.Tensor]:
        """Every weight the step (and prompt writes) read."""
        stop = self.model.stop_head.parameters()
        return [*self.proj.tensors(), self.embed, *self.norms, self.final_norm, self.head_w, *stop]

    def _model_parameters(self) -> list[torch.nn.Parameter]:
        return [*self.model.lm.parameters(), *self.model.stop_head.parameters()]

    def unread_parameters(self) -> list[torch.nn.Parameter]:
        """The model's parameters in storages the step never reads (every parameter of such
        a storage): what a serving run may park off the device (api/parking.py)."""
        read = _storages(self._reads())
        return [
            p
            for p in self._model_parameters()
            if p.untyped_storage().nbytes() and p.untyped_storage().data_ptr() not in read
        ]

    def memory(self) -> dict[str, int]:
        """Bytes this decoder holds on its device, by what they are: `weights_read`, every
        weight its step reads; `weights_copied`, the part of those not in a tensor the model
        itself holds (the head's gathered rows: small; FP8 projections: theirs);
        `weights_unread`, the model's weights its step never reads, still on the device
        (the full vocabulary head; with FP8 projections, their bf16 originals; 0 while
        parked); `cache`, its K/V rows."""
        reads = self._reads()
        storages = {  # the model's weights by storage: views of one tensor counted once
            p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
            for p in self._model_parameters()
        }
        read = _storages(reads)
        copied = [t for t in reads if t.untyped_storage().data_ptr() not in storages]
        return {
            "weights_read": tensor_bytes(*reads),
            "weights_copied": tensor_bytes(*copied),
            "weights_unread": sum(n for ptr, n in storages.items() if ptr not in read),
            "cache": tensor_bytes(self.k, self.v, self.k_scale, self.v_scale),
        }

    # ------------------------------------------------------------------ the layers

    def _layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend
    ) -> torch.Tensor:
        """x [b, t, H] through every block; `attend(i, q, k, v)` writes the cache and attends.
        With glue 'triton' (here: prompt writes; its steps run `_forward_fused`) the norms
        and the SwiGLU are one kernel each, as in its steps."""
        b, t = x.shape[:2]
        norm, swiglu_rows = layer_norm, None
        if self.glue == "triton":
            from orchestrate.techniques.rumik.kernels import rope_norm, swiglu

            norm, swiglu_rows = rope_norm.layer_norm, swiglu.swiglu_rows
        for i, norm_w in enumerate(self.norms):
            xn = norm(x, norm_w, self.eps)
            q, k, v, gate, up = self.proj.qkvgu(i, xn)
            q = q.view(b, t, self.hq, self.d).transpose(1, 2)
            k = k.view(b, t, self.hkv, self.d).transpose(1, 2)
            v = v.view(b, t, self.hkv, self.d).transpose(1, 2)
            if self.sliding[i]:  # full-attention layers carry no positional encoding
                q, k = rotate_half_pairs(q, cos, sin), rotate_half_pairs(k, cos, sin)
            attn = attend(i, q, k, v).transpose(1, 2).reshape(b, t, self.hq * self.d)
            if swiglu_rows is None:
                act = F.silu(gate) * up
            else:  # [b, t, F] column slices: b * t strided rows
                act = swiglu_rows(gate.reshape(b * t, -1), up.reshape(b * t, -1)).view(b, t, -1)
            x = self._residual(i, x, attn, act)
        return norm(x, self.final_norm, self.eps)

    def _residual(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor
    ) -> torch.Tensor:
        """x + o_proj(attn) + down_proj(act) as two GEMMs that add into their input (the
        BLAS epilogue's C): the model's own o_proj and down_proj weights, no concatenated
        copy of them and no concatenation of [attn, act] per step. Other projections add
        their own way."""
        if not self.own_proj:
            return self.proj.residual(i, x, attn, act)
        w_o, w_down = self.proj.w_o[i], self.proj.w_down[i]
        y = torch.addmm(x.flatten(0, -2), attn.flatten(0, -2), w_o.t())
        return torch.addmm(y, act.flatten(0, -2), w_down.t()).view(x.shape)

    def _write(self, i: int, at: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [..., d] into layer i's cache at index `at` (rows, heads,
        positions); fp8: each vector quantized with its own scale (APPROXIMATE), with glue
        'triton' by one kernel (kernels/fp8_rows.py on CUDA: the same bytes); int4: packed as
        int4_cache.quantize_int4 packs it (APPROXIMATE)."""
        if not self.kv_scaled:
            self.k[(i, *at)] = k
            self.v[(i, *at)] = v
            return
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if self.kv == "int4":
                q, scale = quantize_int4(x)
                scale = scale[..., None]
            elif self.glue == "triton":
                q, scale = quantize_activations(x.reshape(-1, x.shape[-1]))
                q, scale = q.view(x.shape), scale.view(*x.shape[:-1], 1)
            else:
                q, scale = quantize_rows(x)
            cache[(i, *at)] = q
            scales[(i, *at)] = scale[..., 0]

    # ------------------------------------------------------------------ prefill

    def prefill(
        self, rows: list[int], prompts: list[list[int]], seeds: list[int], allow_end: list[bool]
    ) -> None:
        """Write each prompt but its last token into its row's cache (rows decoding elsewhere
        are untouched) and arm the row: its next step reads the last prompt token."""
        dev = self.ids.device
        t = max(len(p) for p in prompts) - 1
        if t > 0:
            self.write_prompts(self.to_device(rows), prompt_ids(prompts, t, dev))
        self.arm(rows, prompts, seeds, allow_end)

    def write_prompts(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Prompts `ids` [n, t] (right-padded) into cache rows `rows` [n], positions [0, t):
        fixed shapes, no host sync, so a CUDA graph per (n, t) can replay it. A padded
        position is overwritten by the row's own step before the row reads it; a padding
        row may be `scratch`, a cache row no stream owns."""
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device)
        cos, sin = self.cos[positions], self.sin[positions]
        ahead = positions[:, None] - positions[None, :]
        causal, sliding = ahead >= 0, (ahead >= 0) & (ahead < self.window)

        def attend(i: int, q, k, v) -> torch.Tensor:
            # the prompt attends over its own exact keys; the cache keeps what later steps read
            self._write(i, (rows, slice(None), slice(0, t)), k, v)
            mask = sliding if self.sliding[i] else causal
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.d**-0.5, enable_gqa=True
            )

        self._layers(F.embedding(ids, self.embed), cos, sin, attend)

    def arm(
        self, rows: list[int], prompts: list[list[int]], seeds: list[int], allow_end: list[bool]
    ) -> None:
        """Each row's state for its new stream: its next step reads its last prompt token."""
        # index_fill_, never `t[r] = 0`: under a CUDA index torch copies a Python scalar to
        # the device blocking, a stream sync that waits for a pipelined step in flight
        r = self.to_device(rows)
        self.ids[r] = self.to_device([p[-1] for p in prompts])
        self.pos[r] = self.to_device([len(p) - 1 for p in prompts])
        self.count.index_fill_(0, r, 0)
        self.seed[r] = self.to_device([s & _M32 for s in seeds])
        self.allow_end[r] = self.to_device(allow_end, torch.bool)
        self.active.index_fill_(0, r, 1)

    def hold(self, rows: list[int]) -> None:
        """Rows whose prompts go in by chunks: inactive, at position -1 until `arm`, so their
        step queries write no key and read no position while their prompts are written."""
        r = self.to_device(rows)
        self.active.index_fill_(0, r, 0)
        self.pos.index_fill_(0, r, -1)

    def deactivate(self, rows: list[int]) -> None:
        """Rows that stop generating: later steps advance nothing of theirs."""
        self.active.index_fill_(0, self.to_device(rows), 0)

    def to_device(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Host values onto the device without waiting for the steps launched before."""
        return to_device_async(torch.tensor(values, dtype=dtype), self.ids.device)

    def stage_chunk(self, rows: list[int], positions: list[int], ids: list[int], c: int) -> None:
        """The prompt tokens the next `step(b, s, c)` carries: token j into cache row
        rows[j] at positions[j]; padded to `c` with tokens writing `scratch`."""
        n = len(ids)
        if not 0 < n <= c <= self.chunk_tokens or len(rows) != n or len(positions) != n:
            raise ValueError(f"stage_chunk: 1 to {c} tokens (at most {self.chunk_tokens})")
        pad = c - n
        for buf, values, fill in (
            (self.chunk_rows, rows, self.scratch),
            (self.chunk_pos, positions, 0),
            (self.chunk_ids, ids, 0),
        ):
            buf[:c].copy_(self.to_device(list(values) + [fill] * pad))

    def splits(self, m: int) -> dict[str, int]:
        """The attention kernel's split options for a launch of m query rows: with
        `attention_splits` "auto", enough splits for about SPLIT_PROGRAMS programs (at
        most 16, over 32-position blocks) while m x kv heads is below SPLIT_BELOW; none
        otherwise (`attention_block` positions a block)."""
        if self.attention_splits != "auto" or m * self.hkv >= SPLIT_BELOW:
            return {"block_s": self.attention_block}
        return {"num_splits": min(16, -(-SPLIT_PROGRAMS // (m * self.hkv))), "block_s": 32}

    # ------------------------------------------------------------------ one step

    def step(self, b: int, s: int, c: int = 0) -> torch.Tensor:
        """One token for rows [0, b) attending over positions [0, s), carrying the first `c`
        staged prompt tokens (`stage_chunk`): graph-capturable (reads and writes only the
        state buffers). Returns `out[:b]`, the sampled token ids."""
        if c and not 0 < c <= self.chunk_tokens:
            raise ValueError(f"step: c {c} beyond chunk_tokens {self.chunk_tokens}")
        pos, count, active = self.pos[:b], self.count[:b], self.active[:b]
        hidden = self._forward_fused(b, c) if c else self._forward(b, s)
        stop = torch.sigmoid(self.model.stop_head(hidden).float())[:, 0] > 0.5
        token = self._sample(hidden, count, stop)
        live = active.bool()
        self.out[:b] = token
        self.ids[:b] = torch.where(live, token, self.ids[:b])
        pos.add_(active)
        count.add_(active)
        return self.out[:b]

    @torch.inference_mode()
    def teacher_forced(
        self, prompts: list[list[int]], tokens: list[list[int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rows [0, len(prompts)) prefilled together, then fed `tokens[r]` step by step
        through the same forward the server steps (never sampled): per step, every row's
        codebook logits [rows, C] and the token id of each column [rows, C]. For fidelity:
        a row's logits against stock's on the same tokens, with other rows beside it."""
        b, steps = len(prompts), len(tokens[0])
        if any(len(t) != steps for t in tokens) or b > self.rows:
            raise ValueError("teacher_forced: one token list per row, all of one length")
        self.prefill(list(range(b)), prompts, [0] * b, [True] * b)
        out = []
        for i in range(steps):
            hidden = self._forward(b, self.capacity)
            logits, q = self._logits(hidden, self.count[:b])
            out.append((logits.clone(), self._column_ids(q, b).clone()))
            self.ids[:b] = torch.tensor([t[i] for t in tokens], device=self.ids.device)
            self.pos[:b] += 1
            self.count[:b] += 1
        self.active[:b] = 0
        return out

    def _forward(self, b: int, s: int) -> torch.Tensor:
        """Rows [0, b)'s next hidden state [b, H], each row's keys and values written at its
        position and attending over its filled positions (within [0, s) for SDPA)."""
        if self.glue == "triton":
            return self._forward_fused(b)
        pos = self.pos[:b]
        x = F.embedding(self.ids[:b, None], self.embed)  # [b, 1, H]
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]
        if self.attention is None:  # SDPA's per-row masks over the bucket's s positions
            ahead = pos[:, None] - self.kv_index[None, :s]  # [b, s]
            full = (ahead >= 0)[:, None, None]  # [b, 1, 1, s]: this row's filled positions
            windowed = full & (ahead < self.window)[:, None, None]
        rows = self.row_index[:b]
        g = self.hq // self.hkv
        split = self.splits(b)  # the attention kernel's, once for every layer

        def attend(i: int, q, k, v) -> torch.Tensor:
            self._write(i, (rows, slice(None), pos), k[:, :, 0], v[:, :, 0])
            if self.attention is not None:  # each row over [0, pos + 1): no mask, no bucket
                span = self.window if self.sliding[i] else 0
                scales = {}
                if self.kv_scaled:
                    scales = {"k_scale": self.k_scale[i, :b], "v_scale": self.v_scale[i, :b]}
                out = self.attention(
                    q[:, :, 0], self.k[i, :b], self.v[i, :b], pos, window=span, length_offset=1,
                    **scales, **split,
                )  # fmt: skip
                return out[:, :, None]
            # The g query heads sharing a kv head become g query rows against it: no GQA
            # expansion, one read of each row's cache per kv head.
            out = F.scaled_dot_product_attention(
                q.reshape(b, self.hkv, g, self.d),
                self.k[i, :b, :, :s],
                self.v[i, :b, :, :s],
                attn_mask=windowed if self.sliding[i] else full,
                scale=self.d**-0.5,
            )
            return out.reshape(b, self.hq, 1, self.d)

        return self._layers(x, cos, sin, attend)[:, 0]  # [b, H]

    def _forward_fused(self, b: int, c: int = 0) -> torch.Tensor:
        """`_forward` with glue 'triton': per layer one LayerNorm kernel, the packed
        projection, one kernel rotating every row's q and k at its own position and writing k
        and v into its cache row, the attention kernel, one SwiGLU kernel and the two output
        GEMMs adding into the residual; seven launches where the torch glue takes about
        thirty (fp32 casts, the rotary's slices and stacks, two cache writes; with kv fp8,
        eighteen more for the quantization). The same fp32 maths, rounded to the model dtype
        at the same points (exact up to rounding order); an fp8 cache gets the same bytes.
        With projections that take quantized rows (fp8_projections), the norm's and the
        SwiGLU's kernels also quantize the rows they write, as quantize_rows would.
        With `c` staged prompt tokens, they are rows b.. of every projection and go to
        their cache rows through the kernels' row maps; the head reads rows [0, b)."""
        from orchestrate.techniques.rumik.kernels import rope_norm, swiglu

        pos, ids, rows = self.pos[:b], self.ids[:b], {}
        if c:
            pos = torch.cat([pos, self.chunk_pos[:c]])
            ids = torch.cat([ids, self.chunk_ids[:c]])
            rows = {"cache_rows": torch.cat([self.row_index[:b], self.chunk_rows[:c]])}
        m = b + c
        split = self.splits(m)  # the attention kernel's, once for every layer
        x = F.embedding(ids, self.embed)  # [m, H]
        # FP8 projections: the norm's and the SwiGLU's kernels quantize what they write
        quantized = self.proj.quantized_rows
        for i, norm_w in enumerate(self.norms):
            if quantized:
                xq, xs = rope_norm.layer_norm_fp8(x, norm_w, self.eps)
                q, k, v, gate, up = self.proj.qkvgu_rows(i, xq, xs, x.dtype)
            else:
                q, k, v, gate, up = self.proj.qkvgu(i, rope_norm.layer_norm(x, norm_w, self.eps))
            cached = slice(None) if c else slice(0, b)  # a row map reads any cache row
            k_cache, v_cache = self.k[i, cached], self.v[i, cached]
            scales = {}
            if self.kv_scaled:  # written by the rotary kernel, read by attention
                scales = {"k_scale": self.k_scale[i, cached], "v_scale": self.v_scale[i, cached]}
            q = rope_norm.rope_and_cache_write_rows(
                q.view(m, self.hq, self.d), k.view(m, self.hkv, self.d),
                v.view(m, self.hkv, self.d), k_cache, v_cache, pos, self.cos_pairs,
                self.sin_pairs, rotary=self.sliding[i], **scales, **rows,
            )  # fmt: skip
            span = self.window if self.sliding[i] else 0
            attn = self.attention(
                q, k_cache, v_cache, pos, window=span, length_offset=1, **scales, **rows,
                **split,
            )  # fmt: skip
            attn = attn.view(m, self.hq * self.d)
            if quantized:
                aq, a_s = swiglu.swiglu_rows_fp8(gate, up)
                x = self.proj.residual_rows(i, x, attn, aq, a_s)
            else:
                x = self._residual(i, x, attn, swiglu.swiglu_rows(gate, up))
        return rope_norm.layer_norm(x[:b], self.final_norm, self.eps)

    def _logits(
        self, hidden: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's logits [b, C], float32, and the codebook q [b] they are of (count % 8)
        with the codebook head; with the audio head every row has every unit (q None)."""
        b, c = hidden.shape[0], self.columns
        logits = (F.linear(hidden, self.head_w) * self.head.scale).float()
        if self.head_kind == "audio":
            return logits, None
        q = count % self.head.num_quantizers
        every = logits.view(b, -1, c)
        return every.gather(1, q[:, None, None].expand(b, 1, c))[:, 0], q

    def _column_ids(self, q: torch.Tensor | None, b: int) -> torch.Tensor:
        """The token id of each row's every column [b, C] (for fidelity, not the step)."""
        return self.head.ids.expand(b, self.columns) if q is None else self.head.ids[q]

    def _sample(
        self, hidden: torch.Tensor, count: torch.Tensor, stop: torch.Tensor
    ) -> torch.Tensor:
        """Each row's logits -> a seeded top-k draw -> its token id (the id of the drawn
        column alone: the step gathers no [b, C] table of ids)."""
        b = hidden.shape[0]
        logits, q = self._logits(hidden, count)
        col = self._columns(logits, count, stop, self.seed[:b], self.allow_end[:b])
        return self.head.ids[col] if q is None else self.head.ids[q, col]

    def draw(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        count: torch.Tensor,
        stop: torch.Tensor,
        seed: torch.Tensor,
        allow_end: torch.Tensor,
    ) -> torch.Tensor:
        """The server's sampler on given rows ([b, C] logits and column ids; per row its
        token count, stop-head verdict, seed and whether end-of-audio may be drawn): the
        token ids the step would draw. For fidelity's sampler check."""
        col = self._columns(logits, count, stop, seed, allow_end)
        return ids.gather(1, col[:, None])[:, 0]

    def _columns(
        self,
        logits: torch.Tensor,
        count: torch.Tensor,
        stop: torch.Tensor,
        seed: torch.Tensor,
        allow_end: torch.Tensor,
    ) -> torch.Tensor:
        """Top-k by Gumbel-max with noise hashed from (seed, count, column): the column each
        row draws; the stop head forces end-of-audio where it may end."""
        c = logits.shape[-1]
        may_end = allow_end & (count >= self.stop_from)
        end_col = torch.full_like(count, self.head.end)
        cols = torch.arange(c, device=logits.device)
        allowed = (cols[None, :] != self.head.end) | may_end[:, None]
        scores = logits.masked_fill(~allowed, float("-inf")) / self.sampling.temperature
        top_vals, top_idx = torch.topk(scores, min(self.sampling.top_k, c), dim=-1)
        noisy = top_vals + gumbel_noise(seed, count, top_idx)
        col = top_idx.gather(1, noisy.argmax(-1, keepdim=True))[:, 0]
        return torch.where(may_end & stop, end_col, col)


def glue_refusal(glue: str, attention: str) -> str | None:
    """Why `glue` cannot serve with this attention, or None."""
    if glue not in GLUE:
        return f"glue {glue!r}: one of {', '.join(GLUE)}"
    if glue == "triton" and attention != "triton":
        return "glue 'triton' needs attention 'triton' (a CUDA step of kernels throughout)"
    return None


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    """The storages these tensors are views of, by address."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def prompt_ids(prompts: list[list[int]], t: int, device: torch.device) -> torch.Tensor:
    """Every prompt but its last token, right-padded with 0 to `t` columns: [n, t] (built on
    the host, copied without waiting for the device's queued work)."""
    ids = torch.tensor([p[:-1] + [0] * (t + 1 - len(p)) for p in prompts])
    return to_device_async(ids, device)


def _attention(name: str, model: RumikModel):
    """None for SDPA (the step's own code), else the batched kernel; refused where it
    cannot run, before any cache is allocated."""
    if name not in ATTENTION:
        raise ValueError(f"attention {name!r}: one of {', '.join(ATTENTION)}")
    if name == "sdpa":
        return None
    import os

    if model.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention 'triton' needs a CUDA device (or TRITON_INTERPRET=1)")
    if model.config.head_dim != 128:
        have = model.config.head_dim
        raise ValueError(f"attention 'triton' needs head_dim 128, the model has {have}")
    from orchestrate.techniques.rumik.kernels.batched_attention import batched_decode_attention

    return batched_decode_attention
