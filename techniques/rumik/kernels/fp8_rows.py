"""Each row of an activation quantized to e4m3 with its own scale, in one launch
(fp8_projections' activations, APPROXIMATE by design).

Contract
--------
`quantize_rows_fp8(x[M, K]) -> (q[M, K] float8_e4m3fn, scale[M, 1] float32)` with exactly
what fp8_projections.quantize_rows computes in torch: amax = max |x| over the row (in x's
dtype, then float32, at least 1e-12), scale = amax / 448, q = clamp(x / scale, -448, 448)
rounded to nearest e4m3. x may be a strided view (column slices of a packed projection's
output): only the last dim must be contiguous. K <= 16384 (one row in one program's
registers). No host synchronisation: CUDA-graph safe.

Why it exists
-------------
The torch form is nine kernels (abs, amax, cast, clamp, divide, divide, clamp, cast, ...)
before each of a step's 108 FP8 GEMMs; at 512 rows that quantization cost more than the FP8
GEMM saved over bf16 (benchmarks/h100/serving/fp8-gemm.json: 1.77x the bf16 time with it,
0.70x without). Here a row is read once and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, next_pow2

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MAX_WIDTH = 16384


@triton.jit
def e4m3_row(x):
    """One row x [BLOCK] in float32 (masked lanes 0) -> (x / scale clamped to +-448, ready
    to store as e4m3; scale): quantize_rows' maths. Shared by every kernel that quantizes
    the row it writes (here, rope_norm.layer_norm_fp8, swiglu.swiglu_rows_fp8)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    return tl.clamp(x / scale, -448.0, 448.0), scale


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    q, scale = e4m3_row(x)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(scale_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]); see the module contract."""
    check_device("quantize_rows_fp8", x)
    check_dtype("quantize_rows_fp8", x, FLOAT_DTYPES)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"quantize_rows_fp8: x must be [M, K] with a contiguous last dim, got "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    m, k = x.shape
    if not 1 <= k <= MAX_WIDTH:
        raise ValueError(f"quantize_rows_fp8: rows of 1..{MAX_WIDTH} values, got {k}")
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = next_pow2(k)
    _quantize_rows_kernel[(m,)](
        x, q, scale, k, x.stride(0), q.stride(0),
        BLOCK=block, num_warps=4 if block <= 2048 else 16,
    )  # fmt: skip
    return q, scale
