"""FP8 projections for batched serving (APPROXIMATE): e4m3 weights with one scale per output
channel, each activation row quantized with its own scale as it arrives, and cuBLASLt's FP8
GEMM (torch._scaled_mm, row-wise scales) producing bf16, or (`gemm: triton`) the same
products through kernels/fp8_gemm.py, whose tiles fit a serving step's row counts.

Why: at serving batch sizes the projections are bound by the tensor cores, not by reading
weights (issue 34: the 36 layers' bf16 projections take 4.1 ms at 512 rows on the H200, 708
TFLOP/s); Hopper's FP8 tensor cores run at twice the bf16 rate, and the weights a step reads
halve. What it changes: every projection weight keeps 3 mantissa bits under its channel's
scale, every activation row likewise under its row's, so each product carries a relative
error of a few percent; the logits' divergence from stock is measured by fidelity, never
assumed, and the stack goes through the quality gates.

At one row (a server's smallest bucket) the step only streams weights, and cuBLASLt's FP8
GEMM reads them there no faster than bf16 (benchmarks/h100/serving/fp8-gemm-kernel-quant.json:
1.01x); one row's products go through int8_gemv's GEMV instead, which reads e4m3 weights
and an e4m3 row with its scale: the same products, summed in another order.

Only batched_decode reads it (`after`); a single-stream decoder's GEMV is int8_projections'.
The model keeps its bf16 weights (stock, fidelity and prefill of other stacks read them);
the server reports them as held but unread (`memory()["weights_unread"]`).

`emulate` (any device; the CPU tests) computes the same quantized products in float32
matmuls of the dequantized operands: the same rounding of every operand, another summation
order than cuBLASLt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from orchestrate.api.technique import Technique, TechniqueParams, UnsupportedConfig
from orchestrate.families.rumik.engine import Engine, Projections, tensor_bytes
from orchestrate.families.rumik.model import RumikModel, input_projections, packed_input_weight

if TYPE_CHECKING:
    from orchestrate.techniques.rumik.kernels.fp8_gemm import GemmConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3fn has no infinity, beyond it is NaN
GEMMS = ("cublas", "triton")  # who multiplies two or more rows on CUDA
Gemm = Literal["cublas", "triton"]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., k] -> (e4m3 [..., k], float32 scales [..., 1]), x ~ q * scale, each row's
    (last dim's) largest |value| mapped to FP8_MAX. No host synchronisation
    (graph-capturable); nine kernels on a GPU, unfused (`quantize_activations` runs
    kernels/fp8_rows.py's one kernel there instead, the same values)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@dataclass
class Fp8Weight:
    q: torch.Tensor  # [n, k] e4m3, row-major: its transpose is the column-major operand
    scale: torch.Tensor  # [1, n] float32: output channel j's scale (what _scaled_mm takes)

    @classmethod
    def of(cls, w: torch.Tensor) -> Fp8Weight:
        q, scale = quantize_rows(w)
        return cls(q, scale.t().contiguous())

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of x [m, k] rows: one Triton kernel on CUDA (kernels/fp8_rows.py,
    the same values: a GPU test compares them), torch's ops elsewhere."""
    if x.is_cuda:
        from orchestrate.techniques.rumik.kernels import fp8_rows

        if x.stride(-1) == 1 and x.shape[-1] <= fp8_rows.MAX_WIDTH:
            return fp8_rows.quantize_rows_fp8(x)
    return quantize_rows(x)


def fp8_matmul(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: Fp8Weight,
    emulate: bool,
    dtype: torch.dtype,
    gemm: Gemm = "cublas",
) -> torch.Tensor:
    """Quantized rows xq [m, k] (scales xs [m, 1]) @ w.T -> [m, n] in `dtype`."""
    if emulate:
        y = (xq.float() * xs) @ (w.q.float() * w.scale.t()).t()
    elif xq.shape[0] == 1:  # a weight stream: the GEMV, at the read rate (module doc)
        from orchestrate.techniques.rumik.kernels.int8_gemv import int8_linear

        y = int8_linear(xq, w.q, w.scale, x_scale=xs, out_dtype=torch.bfloat16)
    elif gemm == "triton" and (cfg := _triton_tile(xq.shape[0], *w.q.shape)) is not None:
        from orchestrate.techniques.rumik.kernels.fp8_gemm import fp8_gemm

        y = fp8_gemm(xq, xs, w.q, w.scale, cfg)
    else:  # row-wise scales need bf16 output; a bf16 model is what the GPU serves
        y = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale, out_dtype=torch.bfloat16)
    return y.to(dtype)


def _triton_tile(m: int, n: int, k: int) -> GemmConfig | None:
    """kernels/fp8_gemm.py's measured tile for this product, or None: cuBLASLt there (the
    kernel's table covers the shapes and row counts where its tile beat cuBLASLt)."""
    from orchestrate.techniques.rumik.kernels.fp8_gemm import config_for

    return config_for(m, n, k)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, emulate: bool, gemm: Gemm = "cublas") -> torch.Tensor:
    """x [..., k] @ w.T in FP8 -> [..., n] in x's dtype."""
    lead = x.shape[:-1]
    xq, xs = quantize_activations(x.reshape(-1, x.shape[-1]))
    return fp8_matmul(xq, xs, w, emulate, x.dtype, gemm).view(*lead, -1)


class Fp8Packed(Projections):
    """q,k,v,gate,up as one FP8 weight per layer (packed_projections' layout), o_proj and
    down_proj as two; `serves_rows`: batched_decode's step may read it."""

    serves_rows = True
    quantized_rows = True  # qkvgu_rows / residual_rows: rows quantized by the caller's kernels
    # One row on CUDA: the residual adds in the GEMVs' epilogue (residual_rows); off, two
    # add kernels a layer (benchmarks/batched_step.py times both in one run).
    residual_epilogue = True

    @torch.no_grad()
    def __init__(self, model: RumikModel, emulate: bool | None = None, gemm: Gemm = "cublas"):
        if gemm not in GEMMS:
            raise ValueError(f"fp8 gemm {gemm!r}: one of {', '.join(GEMMS)}")
        self.gemm = gemm
        self.emulate = model.device.type != "cuda" if emulate is None else emulate
        if not self.emulate and model.lm.dtype != torch.bfloat16:
            have = model.lm.dtype
            raise UnsupportedConfig(f"fp8 projections on CUDA serve a bfloat16 model, not {have}")
        self.w_in: list[Fp8Weight] = []
        self.w_o: list[Fp8Weight] = []
        self.w_down: list[Fp8Weight] = []
        for layer in model.lm.model.layers:
            parts = input_projections(layer)
            packed = packed_input_weight(layer)
            w_in = packed if packed is not None else torch.cat([p.weight for p in parts])
            self.w_in.append(Fp8Weight.of(w_in))
            self.w_o.append(Fp8Weight.of(layer.self_attn.o_proj.weight))
            self.w_down.append(Fp8Weight.of(layer.mlp.down_proj.weight))
        self.sizes = [p.out_features for p in input_projections(model.lm.model.layers[0])]

    def tensors(self) -> list[torch.Tensor]:
        return [t for w in (*self.w_in, *self.w_o, *self.w_down) for t in w.tensors()]

    def weight_bytes(self) -> int:
        return tensor_bytes(*self.tensors())

    def qkvgu(self, i: int, xn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = fp8_linear(xn, self.w_in[i], self.emulate, self.gemm)
        return tuple(y.split(self.sizes, dim=-1))

    def qkvgu_rows(
        self, i: int, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, ...]:
        """`qkvgu` of the normed rows already quantized (xq [m, H] e4m3, xs [m, 1]): what
        qkvgu computes from the norm, its quantization done by the norm's kernel."""
        y = fp8_matmul(xq, xs, self.w_in[i], self.emulate, dtype, self.gemm)
        return tuple(y.split(self.sizes, dim=-1))

    def residual_rows(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, aq: torch.Tensor, a_s: torch.Tensor
    ) -> torch.Tensor:
        """`residual` with the MLP activation already quantized (aq [m, F] e4m3, a_s [m,
        1]) by the SwiGLU's kernel; attn is quantized here. One row on CUDA with
        `residual_epilogue`: each GEMV adds its input's residual in its epilogue, (x + o) +
        down, each sum in fp32 rounded once, instead of two add kernels a layer."""
        if self.residual_epilogue and not self.emulate and aq.shape[0] == 1:
            from orchestrate.techniques.rumik.kernels.int8_gemv import int8_linear

            w_o, w_down = self.w_o[i], self.w_down[i]
            oq, o_s = quantize_activations(attn.reshape(1, -1))
            h = int8_linear(oq, w_o.q, w_o.scale, x_scale=o_s, residual=x.reshape(-1))
            y = int8_linear(aq, w_down.q, w_down.scale, x_scale=a_s, residual=h.reshape(-1))
            return y.view(x.shape)
        o = fp8_linear(attn, self.w_o[i], self.emulate, self.gemm)
        return x + (o + fp8_matmul(aq, a_s, self.w_down[i], self.emulate, x.dtype, self.gemm))

    def output(self, i: int, attn: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """o_proj(attn) + down_proj(act), without the residual."""
        o = fp8_linear(attn, self.w_o[i], self.emulate, self.gemm)
        return o + fp8_linear(act, self.w_down[i], self.emulate, self.gemm)

    def residual(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor
    ) -> torch.Tensor:
        return x + self.output(i, attn, act)


class Fp8ProjectionsParams(TechniqueParams):
    # two or more rows on CUDA: cuBLASLt's FP8 GEMM, or kernels/fp8_gemm.py (the same
    # products, its tile per row count: benchmarks/fp8_gemm.py times both)
    gemm: Gemm = "cublas"


class Fp8Projections(Technique):
    name = "fp8_projections"
    version = 2  # 2: `gemm`
    family = "rumik"
    exact = False  # every weight and activation rounded to e4m3 under its row's scale
    slots = ("projections",)
    requires = ("cuda", "sm90")  # Hopper's FP8 tensor cores, row-wise scaled GEMM
    after = ("batched_decode",)  # the only reader of these projections (see module doc)
    summary = (
        "APPROXIMATE: FP8 (e4m3) projections for batched serving, a scale per weight "
        "channel and per activation row (cuBLASLt FP8 GEMM)"
    )
    Params = Fp8ProjectionsParams

    def apply(self, engine: Engine) -> None:
        p: Fp8ProjectionsParams = self.params  # type: ignore[assignment]
        engine.projections = Fp8Packed(engine.model, gemm=p.gemm)  # type: ignore[attr-defined]
