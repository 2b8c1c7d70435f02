"""The whole unmasking loop as one captured CUDA graph: APPROXIMATE (other random stream).

At the recipe's settings a step costs ~3.3 ms on an H200 against a ~0.74 ms forward: the
forward is one graph, but guidance, top-k filtering, Gumbel noise, position scores, topk
and the write-back run eagerly, dozens of small launches plus Python per item per step.
Here every step is device-only work on static buffers with static shapes, so all num_step
steps (forwards included) are captured once per request shape and replayed as one graph.

Same math as slot_loop (StockGuidance, predict, position_scores), batched over items:
  * only the target positions' logits are cast to float32 (slot_loop casts all of them);
  * each step commits the k best-scored masked positions shape-statically: topk of the
    step's largest k over all items, then ranks < the item's own k (a device table);
  * positions past an item's length start committed (never chosen, never written back).
With position_temperature = class_temperature = 0 it returns slot_loop's codes (CPU test).
With noise, the Gumbel draws come from the graph-safe Philox stream in one batched draw
per step, not the package's per-item draws: the same seed gives other codes (exact=False).
The step function runs eagerly too (that is how the CPU tests prove the math); capture is
a thin layer over it. The loop object the technique installs (`GraphLoop`) owns its static
loops and their graph pool, so each engine keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.omnivoice.engine import (
    CFGBatch,
    Engine,
    SlotReadingLoop,
    StockGuidance,
    build_cfg_batch,
    position_scores,
    predict,
)

if TYPE_CHECKING:  # the package is imported when an engine runs (families/omnivoice/engine.py)
    from omnivoice.models.omnivoice import GenerationTask, OmniVoiceGenerationConfig


@dataclass(frozen=True)
class Layout:
    """Everything that fixes the captured work: shapes, lengths, and the cfg values."""

    B: int
    C: int
    S: int
    c_lens: tuple[int, ...]
    t_lens: tuple[int, ...]
    num_step: int
    t_shift: float
    guidance_scale: float
    class_temperature: float
    position_temperature: float
    layer_penalty_factor: float

    @classmethod
    def of(cls, batch: CFGBatch, cfg: OmniVoiceGenerationConfig) -> Layout:
        B, C, S = batch.input_ids.shape[0] // 2, batch.input_ids.shape[1], batch.input_ids.shape[2]
        return cls(
            B, C, S, tuple(batch.c_lens), tuple(batch.t_lens), cfg.num_step, cfg.t_shift,
            cfg.guidance_scale, cfg.class_temperature, cfg.position_temperature,
            cfg.layer_penalty_factor,
        )  # fmt: skip

    @property
    def T(self) -> int:
        return max(self.t_lens)

    @property
    def uniform(self) -> bool:
        """All items share one length and one prompt length (the batch technique's copies)."""
        return len(set(self.c_lens)) == 1 and len(set(self.t_lens)) == 1


class StaticLoop:
    """Static buffers + the eager step function for one Layout; `capture` graphs `run`."""

    def __init__(self, engine: Engine, layout: Layout, batch: CFGBatch, cfg: Any):
        ov, dev = engine.model.ov, batch.input_ids.device
        self.engine, self.layout, self.cfg = engine, layout, cfg
        self.mask_id = int(ov.config.audio_mask_id)
        B, C, T = layout.B, layout.C, layout.T
        # Inputs: copied in before each run (the steps write the sample into input_ids).
        self.input_ids = batch.input_ids.clone()
        self.audio_mask = batch.audio_mask.clone()
        self.attention_mask = batch.attention_mask.clone()
        # Positions past an item's length start committed (0 is any non-mask id): their
        # scores are -inf, so they are never chosen; outputs are sliced to t_len.
        j = torch.arange(T, device=dev)
        t = torch.tensor(layout.t_lens, device=dev).view(B, 1)
        c = torch.tensor(layout.c_lens, device=dev).view(B, 1)
        valid = j < t  # [B, T]
        self.init_tokens = torch.where(valid, self.mask_id, 0).view(B, 1, T).expand(B, C, T)
        self.init_tokens = self.init_tokens.contiguous()
        self.tokens = self.init_tokens.clone()
        # Schedule: per step, the largest k (a Python int baked into the step's topk) and
        # each item's own k (a device table compared against ranks).
        sched = engine.schedule(list(layout.t_lens), cfg, C)  # [B][num_step]
        self.kmax = [max(s[step] for s in sched) for step in range(layout.num_step)]
        self.k_tab = torch.tensor(sched, device=dev).T.reshape(layout.num_step, B, 1)
        self.ranks = torch.arange(max(self.kmax, default=0), device=dev)
        if not layout.uniform:
            # Gather maps for mixed lengths: target position j of item i in each row
            # (clamped for j >= t_len: those logits are read but never used).
            jj = torch.minimum(j.view(1, T), t - 1)
            self.cond_idx = (c - t + jj).view(B, 1, T, 1)
            self.uncond_idx = jj.view(B, 1, T, 1)
            # Write-back map: for each row and sequence position, which token (if any).
            s = torch.arange(layout.S, device=dev).view(1, layout.S)
            cond_hit = (s >= c - t) & (s < c)
            uncond_hit = s < t
            self.src = torch.cat([(s - (c - t)).clamp(0, T - 1), s.clamp(max=T - 1).expand(B, -1)])
            self.hit = torch.cat([cond_hit, uncond_hit]).view(2 * B, 1, layout.S)
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, batch: CFGBatch) -> None:
        self.input_ids.copy_(batch.input_ids)
        self.audio_mask.copy_(batch.audio_mask)
        self.attention_mask.copy_(batch.attention_mask)

    def run(self) -> None:
        """All steps, device-only: no host reads, no branching on tensor values."""
        self.tokens.copy_(self.init_tokens)
        for step in range(self.layout.num_step):
            self.step(step)

    def step(self, step: int) -> None:
        L, cfg = self.layout, self.cfg
        logits = self.engine.forward(self.input_ids, self.audio_mask, self.attention_mask)
        cond, uncond = self._targets(logits)
        log_probs = StockGuidance().log_probs(cond, uncond, cfg)  # [B, C, T, V]
        k = self.kmax[step]
        if k == 0:  # a baked constant: no item commits anything this step
            return
        pred, conf = predict(log_probs, cfg, self.mask_id)
        scores = position_scores(conf, self.tokens, cfg, self.mask_id).flatten(1)
        idx = scores.topk(k, dim=-1).indices  # [B, k], ranked best first
        keep = self.ranks[:k].view(1, k) < self.k_tab[step]  # ranks < the item's own k
        flat = self.tokens.view(L.B, -1)
        new = torch.where(keep, pred.flatten(1).gather(1, idx), flat.gather(1, idx))
        flat.scatter_(1, idx, new)  # distinct indices per row: deterministic
        self._write_back()

    def _targets(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cond and uncond logits of the target positions only, cast to float32 after the
        slice (elementwise: the same values slot_loop gets from casting everything)."""
        L = self.layout
        if L.uniform:
            c, t = L.c_lens[0], L.t_lens[0]
            return logits[: L.B, :, c - t : c].float(), logits[L.B :, :, :t].float()
        shape = (L.B, L.C, L.T, logits.shape[-1])
        cond = logits[: L.B].gather(2, self.cond_idx.expand(shape))
        uncond = logits[L.B :].gather(2, self.uncond_idx.expand(shape))
        return cond.float(), uncond.float()

    def _write_back(self) -> None:
        """The sample into both CFG rows of each item, as slot_loop's slice copies do."""
        L = self.layout
        if L.uniform:
            c, t = L.c_lens[0], L.t_lens[0]
            self.input_ids[: L.B, :, c - t : c].copy_(self.tokens)
            self.input_ids[L.B :, :, :t].copy_(self.tokens)
            return
        both = torch.cat([self.tokens, self.tokens])  # [2B, C, T]
        picked = both.gather(2, self.src.view(2 * L.B, 1, L.S).expand(-1, L.C, -1))
        self.input_ids.copy_(torch.where(self.hit, picked, self.input_ids))

    def capture(self, pool: Any) -> None:
        """Warm up on a side stream (compile, cuBLAS workspaces), then capture `run`.

        The warm-up draws noise: the CUDA RNG state is restored so the synthesis that
        triggers the capture draws the same stream as later ones with the same seed.
        """
        rng = torch.cuda.get_rng_state(self.input_ids.device)
        saved = self.input_ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # first call compiles; the second runs what is captured
                self.input_ids.copy_(saved)
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.input_ids.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.run()
        self.input_ids.copy_(saved)  # capture records the work but does not run it
        torch.cuda.set_rng_state(rng, self.input_ids.device)
        self.graph = graph

    def outputs(self) -> list[torch.Tensor]:
        # Clones: the static buffer is overwritten by the next replay.
        return [self.tokens[i, :, :t].clone() for i, t in enumerate(self.layout.t_lens)]


class GraphLoop(SlotReadingLoop):
    """The `loop` slot (reads forward and schedule): eager CFG batch, then one graph replay
    per synthesis on CUDA (the same steps run eagerly elsewhere: the CPU tests' proof path).
    Keeps one StaticLoop per Layout, captured into one shared graph pool."""

    def __init__(self) -> None:
        self.loops: dict[Layout, StaticLoop] = {}
        self.pool: Any = None  # graphs share one pool; they never run concurrently

    @torch.inference_mode()  # always: static buffers made in it cannot be written outside it
    def __call__(
        self, engine: Engine, task: GenerationTask, cfg: OmniVoiceGenerationConfig
    ) -> list[torch.Tensor]:
        refuse_unsupported(engine)
        batch = build_cfg_batch(engine, task, cfg)
        layout = Layout.of(batch, cfg)
        loop = self.loops.get(layout)
        if loop is None:
            loop = self.loops[layout] = StaticLoop(engine, layout, batch, cfg)
        loop.load(batch)
        if batch.input_ids.is_cuda:
            if loop.graph is None:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                loop.capture(self.pool)
            loop.graph.replay()  # type: ignore[union-attr]
        else:
            loop.run()
        engine.passes.record(layout.num_step, layout.num_step * 2 * layout.B)
        return loop.outputs()


# ------------------------------------------------------------------- what it refuses

NOT_READ = {"guidance": "cfg_late_off", "unmask": "confidence_parallel"}


def refuse_unsupported(engine: Engine) -> None:
    """Slots this loop does not read (filled later in the stack than check_stack sees), and
    a compiled forward that records its own CUDA graphs."""
    for slot in NOT_READ:
        if slot in engine.filled:
            raise RuntimeError(
                f"cuda_graph_loop runs the stock {slot} math; {engine.filled[slot]!r} fills "
                f"the {slot!r} slot, which this loop would silently ignore"
            )
    if getattr(engine.forward, "compile_mode", None) == "reduce-overhead":
        raise RuntimeError(REDUCE_OVERHEAD)


REDUCE_OVERHEAD = (
    "torch_compile mode reduce-overhead records inductor's own CUDA graphs, which cannot be "
    "captured inside this loop's graph; use mode default (or max-autotune-no-cudagraphs)"
)


class CudaGraphLoop(Technique):
    name = "cuda_graph_loop"
    family = "omnivoice"
    exact = False  # the Gumbel draws come from another (graph-safe Philox) random stream
    slots = ("loop",)
    requires = ("cuda",)
    reduces = ("host",)  # one graph launch a step instead of a launch per kernel
    conflicts = tuple(NOT_READ.values())
    summary = (
        "all unmasking steps captured as one CUDA graph per request shape; "
        "APPROXIMATE (other random stream)"
    )

    @classmethod
    def check_stack(
        cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]
    ) -> str | None:
        compiled = earlier.get("torch_compile")
        if compiled is not None and getattr(compiled, "mode", None) == "reduce-overhead":
            return REDUCE_OVERHEAD
        return None

    def apply(self, engine: Engine) -> None:
        engine.loop = GraphLoop()
