"""batched_decode: the engine serves many streams at once (serving workloads only).

Fills the `server` slot with a factory for techniques/rumik/batched_server.py's
continuous-batching server: a static cache of `rows` rows with per-row positions, seeded
per-row top-k, a CUDA graph per batch bucket (captured in the untimed warm-up), streaming
Mimi decode per chunk (between steps, or with `codec: overlap` on a side CUDA stream
while the next step runs; `glue: triton`, the step's norms, rotary, cache writes and SwiGLU as
one kernel each; `chunk_tokens`, new prompts riding along decode steps). The worker drives
it with the workload's load and records per-stream figures (running/serving.py).
APPROXIMATE: the sampler draws stock's top-k distribution from another random stream (as
device_sampler's), and with `head: codebook` (the default) each row samples only codebook
step % 8 (codebook_head's); `head: audio` keeps stock's distribution over every audio
unit. Each row's tokens equal its batch-one run (tests/test_serving.py).
Its fidelity teacher-forces the server's step in one row of a small server beside others,
and draws from its sampler against stock's on that row's logits (families/rumik/fidelity.py).
Top-p is not implemented: a workload with top_p < 1 is refused (and were it not, the sampler
check would fail, as tests/test_serving.py shows).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from orchestrate.api.config import SamplingConfig, Workload
from orchestrate.api.technique import Refused, Technique, TechniqueParams, beyond_rows
from orchestrate.families.rumik.engine import Engine


class BatchedDecodeParams(TechniqueParams):
    rows: int = Field(64, ge=1, le=4096, description="Cache rows: streams live at once.")
    attention: Literal["sdpa", "triton"] = Field(
        "sdpa",
        description="sdpa: masked SDPA over the context bucket (any device); triton: the "
        "batched decode-attention kernel, each row over its own positions (CUDA).",
    )
    graphs: bool = Field(True, description="A CUDA graph per batch bucket (CUDA only).")
    max_prefill_tokens: int = Field(
        4096, ge=1, le=1 << 20, description="Prompt tokens prefilled per admission, at most."
    )
    head: Literal["codebook", "audio"] = Field(
        "codebook",
        description="codebook: each row samples its codebook's (step % 8) units + end "
        "(APPROXIMATE); audio: every audio unit + end, stock's distribution. One matmul "
        "either way (all 8 codebooks' rows); they differ in the columns sampled from.",
    )
    admit_every: int = Field(
        1,
        ge=1,
        le=64,
        description="Admit waiting streams at most every N decode steps while others decode "
        "(each prefill reads every weight once: fewer, larger ones trade up to N steps of "
        "first-audio latency for fewer reads).",
    )
    chunk_tokens: int = Field(
        0,
        ge=0,
        le=1024,
        description="0: each admission's prompts written by a pass of their own (every "
        "weight read again); N: chunked prefill, at most N prompt tokens ride along each "
        "decode step as extra rows of its projections (needs glue triton; the same cache up "
        "to rounding order; with kv fp8 a prompt attends over its quantized keys).",
    )
    pipeline: bool = Field(
        False,
        description="Launch each decode step as soon as the last one's tokens are read "
        "back, so the host's bookkeeping, codec launches and admissions run beside it (the "
        "same tokens; a refilled row starts a step later; needs codec overlap). Measured on "
        "one H100 (FP8, chunked prefill): a sustained 320 load's window served 500 of 506 "
        "streams against 54 unpipelined; at 288 both served all, first audio p95 5.6 ms "
        "later (README, 'Pipelined steps').",
    )
    kv: Literal["model", "fp8", "int4"] = Field(
        "model",
        description="model: the cache in the model's dtype; fp8: e4m3 keys and values, each "
        "position's vector per kv head with its own scale (APPROXIMATE: half the bytes "
        "attention reads; needs attention triton); int4: packed 4-bit keys and values, two "
        "a byte, with the same scales (kernels/int4_cache.py; APPROXIMATE: a quarter of the "
        "bf16 cache's bytes, half of fp8's; needs attention triton). Measured slower than "
        "fp8 on an H100: its attention took 1.6-1.7x fp8's time, bound by unpacking (README, "
        "'Half the cache's bytes').",
    )
    glue: Literal["torch", "triton"] = Field(
        "torch",
        description="torch: eager ops between the projections and attention (norms, rotary, "
        "cache writes, SwiGLU); triton: one kernel each (about seven launches a layer "
        "instead of thirty; exact up to rounding order; needs attention triton; with kv fp8 "
        "the rotary kernel quantizes what it writes).",
    )
    codec: Literal["sync", "overlap"] = Field(
        "sync",
        description="sync: a step's completed chunks are decoded before it returns; overlap: "
        "on a side CUDA stream behind the next step's graph (the same audio; CPU: one step "
        "later, no second stream).",
    )
    codec_kv: Literal["gather", "ring"] = Field(
        "gather",
        description="how the codec keeps Mimi's transformer window per stream: gather (the "
        "window gathered, the chunk appended, the last window written back: three passes a "
        "layer) or ring (ring slots, read once a layer; the same keys, the softmax summed in "
        "another order).",
    )
    codec_attention: Literal["sdpa", "triton"] = Field(
        "sdpa",
        description="the codec transformer's attention: sdpa (each decoded row's window "
        "gathered, then a masked SDPA) or triton (kernels/ring_attention.py: each row's ring "
        "read in place, no gather; needs codec_kv ring and CUDA; the same keys, the softmax "
        "summed in another order).",
    )
    codec_precision: Literal["fp32", "tf32", "bf16"] = Field(
        "fp32",
        description="the codec's arithmetic: fp32 (Mimi as it ships: TF32 convolutions, "
        "float32 matmuls), tf32 (matmuls on tensor cores too; APPROXIMATE; CUDA) or bf16 (a "
        "bfloat16 copy of the decoder; APPROXIMATE). benchmarks/codec_bench.py measures "
        "their audio against float32's.",
    )

    codec_every: int = Field(
        1,
        ge=1,
        description="Launch the codec every N decode steps, the chunks completed meanwhile "
        "decoded together (the same audio up to the batch's rounding; each chunk at most N-1 "
        "steps later): a decode's cost is mostly its launches and their latency, not its "
        "rows, so fewer, fuller decodes leave the GPU to the decode steps.",
    )

    @model_validator(mode="after")
    def _kernels_it_needs(self) -> BatchedDecodeParams:
        if self.kv != "model" and self.attention != "triton":
            raise ValueError(
                f"kv {self.kv!r} needs attention 'triton' (its kernel reads the scales)"
            )
        from orchestrate.techniques.rumik.batched_decode import glue_refusal

        if why := glue_refusal(self.glue, self.attention):
            raise ValueError(why)
        if self.pipeline and self.codec != "overlap":
            raise ValueError("pipeline needs codec 'overlap' (a synchronous codec waits for "
                             "the step in flight)")  # fmt: skip
        if self.chunk_tokens and self.glue != "triton":
            raise ValueError("chunk_tokens needs glue 'triton' (its kernels' row maps)")
        if self.codec_attention == "triton" and self.codec_kv != "ring":
            raise ValueError("codec_attention 'triton' reads ring slots: set codec_kv 'ring'")
        return self


def _cuda_options(params: TechniqueParams) -> list[str]:
    """The options set that exist only on CUDA (Triton kernels, TF32 matmuls), as
    "name 'value'"; glue triton and kv fp8 need attention triton, so it covers them."""
    assert isinstance(params, BatchedDecodeParams)
    picked = {
        "attention": params.attention == "triton",
        "codec_attention": params.codec_attention == "triton",
        "codec_precision": params.codec_precision == "tf32",
    }
    return [f"{name} {getattr(params, name)!r}" for name, on in picked.items() if on]


class BatchedDecode(Technique):
    name = "batched_decode"
    # 2: the `head` parameter (its default keeps version 1's codebook head); 3: `codec` and
    # `admit_every` (their defaults keep the codec between steps, an admission every step);
    # 4: o_proj and down_proj add into the residual as two GEMMs over the model's own
    # weights (was one GEMM over a concatenated copy: another summation order); 5: `kv`
    # (its default keeps the cache in the model's dtype); 6: `glue` (its default keeps the
    # eager ops); 7: `codec_kv` and `codec_attention` (their defaults keep the gathered
    # window and SDPA); 8: `chunk_tokens` and `pipeline` (their defaults keep prompts
    # written apart and steps one after another), and
    # the attention kernel splits each row's positions across programs when a bucket has
    # few rows (BatchedDecoder.splits: the same softmax summed in another order); 9:
    # `codec_precision` and `codec_every` (their defaults keep the codec as Mimi ships it,
    # launched every step); 10: `kv: int4` (a new value: the default is unchanged)
    version = 10
    family = "rumik"
    exact = False  # another random stream (and with head codebook, the restricted head)
    slots = ("server",)
    serves_streams = True
    summary = "serve many streams: continuous batching over a row-per-stream static cache"
    Params = BatchedDecodeParams

    @classmethod
    def requirements(cls, params: TechniqueParams) -> tuple[str, ...]:
        return cls.requires + (("cuda",) if _cuda_options(params) else ())

    @classmethod
    def check_workload(cls, params: TechniqueParams, workload: Workload) -> str | None:
        assert isinstance(params, BatchedDecodeParams)
        if why := beyond_rows(workload, params.rows, "streams", "cache rows"):
            return why
        if workload.sampling.top_p < 1.0:
            return (
                f"its sampler draws top-k only; the workload's top_p "
                f"{workload.sampling.top_p:g} is not implemented (set top_p: 1.0)"
            )
        return None

    def apply(self, engine: Engine) -> None:
        params = self.params
        assert isinstance(params, BatchedDecodeParams)
        if engine.model.device.type != "cuda" and (cuda_only := _cuda_options(params)):
            # planning refuses these first (requirements); an engine built directly is not
            raise Refused(f"batched_decode with {cuda_only[0]} needs a CUDA device")

        def build(
            engine: Engine,
            max_seq_len: int,
            sampling: SamplingConfig,
            chunk_frames: int,
            rows: int | None = None,
        ) -> Any:
            from orchestrate.techniques.rumik.batched_server import BatchedServer

            return BatchedServer(
                engine.model,
                rows or params.rows,
                max_seq_len,
                sampling,
                graphs=params.graphs,
                codec=True,
                chunk_frames=chunk_frames,
                max_prefill_tokens=params.max_prefill_tokens,
                attention=params.attention,
                head=params.head,
                codec_overlap=params.codec == "overlap",
                codec_kv=params.codec_kv,
                codec_attention=params.codec_attention,
                codec_precision=params.codec_precision,
                codec_every=params.codec_every,
                admit_every=params.admit_every,
                kv=params.kv,
                glue=params.glue,
                chunk_tokens=params.chunk_tokens,
                pipeline=params.pipeline,
                # a projections technique that serves many rows (fp8_projections), if any
                projections=engine.projections if engine.projections.serves_rows else None,
            )

        engine.server = build
