"""FP8 rows times FP8 weights with row-wise scales, for a serving step's 2 to 512 rows
(fp8_projections' GEMM, APPROXIMATE by design: the operands are e4m3).

Contract
--------
`fp8_gemm(xq[M, K] e4m3, xs[M, 1] f32, wq[N, K] e4m3, ws[1, N] f32, config=None) -> y[M, N]
bf16` with y = (xq @ wq.T) * xs * ws, the products summed in fp32, scaled in fp32 and
rounded once to bf16: what `torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
out_dtype=bf16)` computes, summed in another order. Hopper's FP8 tensor cores accumulate
with fewer bits than fp32; as cuBLASLt does by default (use_fast_accum off), each block of
`block_k` products is added into the fp32 sum (`precise`; off: Triton's default on sm_90,
the whole K in the tensor cores' accumulator). xq's and wq's last dims contiguous; K a
multiple of 16. With `split_k` > 1 the K range is cut into that many slices, each
program's partial sum (scaled) added into an fp32 buffer with atomics, then rounded: the sum's
order then varies from run to run (bitwise, not in value beyond fp32 rounding). No host
synchronisation: CUDA-graph safe.

Why it exists
-------------
At serving batch sizes cuBLASLt's FP8 GEMM reads the step's weights slowly: 108 projections
at the Rumik shape (2.82 GB of e4m3) take 2.287 ms at 64 rows and 2.506 at 256
(benchmarks/h100/serving/fp8-gemm-kernel-quant.json), 1.1-1.2 TB/s against the ~2.8 TB/s an
H100 reads at. The narrow projections (o_proj, down_proj: 2048 outputs) give 128x128 tiles
only 16 column blocks. Here the tile is chosen per shape (`config_for`), programs that share
a weight tile are launched next to each other (rows fastest, so the second read of a tile
is from L2), and split-K gives narrow outputs enough programs to fill the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_device

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 4
    precise: bool = True  # each block_k products added into fp32 (the module contract)

    def label(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}"
            f"w{self.warps}p{self.stages}" + ("" if self.precise else "-fast")
        )


# (n, k) of a Rumik projection -> (most rows, tile) in ascending rows: the fastest tile of
# fp8-gemm-sweep.json (H100, 36 weights a shape in one graph, interleaved with cuBLASLt) at
# 64, 128, 256 and 512 rows, where it beat cuBLASLt; a row count between two swept ones
# takes the larger's tile, and fewer than 64 rows the 64-row tile (not swept below 64).
# o_proj, down_proj, then q,k,v,gate,up (there cuBLASLt was as fast or faster from 128 rows
# on). That sweep ran before `precise` existed, with the tensor cores' own accumulation:
# the precise kernel's times are still to be taken (tests/test_fp8_projections.py ties this
# table to that record, so a new sweep changes both).
TABLE: dict[tuple[int, int], tuple[tuple[int, GemmConfig], ...]] = {
    (2048, 2048): ((256, GemmConfig(64, 32)), (512, GemmConfig(128, 64, warps=8))),
    (2048, 11008): (
        (64, GemmConfig(64, 32, split_k=4)),
        (128, GemmConfig(64, 64, split_k=4)),
        (256, GemmConfig(128, 64, split_k=4, warps=8)),
        (512, GemmConfig(128, 128, split_k=2, warps=8)),
    ),
    (25088, 2048): ((64, GemmConfig(64, 64)),),
}


def config_for(m: int, n: int, k: int) -> GemmConfig | None:
    """The measured tile for this product (TABLE), or None: cuBLASLt is the faster there, or
    the shape was never measured."""
    for most, cfg in TABLE.get((n, k), ()):
        if m <= most:
            return cfg
    return None


def default_config(m: int, n: int, k: int) -> GemmConfig:
    """A plain tile for any shape: rows in blocks of up to 64, 64 columns, no split."""
    return GemmConfig(16 if m <= 16 else 32 if m <= 32 else 64, 64)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m  # rows fastest: a weight tile's readers run side by side
    pid_n = pid // tiles_m
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_w  # [K, N] view of w [N, K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + rk)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if PRECISE:  # noqa: SIM108 - a constexpr branch: one of the two is compiled
            # the block's products summed in the tensor cores, then added in fp32
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(x, w, acc)
    xs = tl.load(xs_ptr + rm, mask=row_ok, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=col_ok, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    out = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, y, mask=ok, sem="relaxed")


def fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """(xq @ wq.T) * xs * ws in bf16; see the module contract."""
    check_device("fp8_gemm", xq, xs, wq, ws)
    if xq.dtype != FP8 or wq.dtype != FP8:
        raise ValueError(f"fp8_gemm: e4m3 operands, got {xq.dtype} and {wq.dtype}")
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"fp8_gemm: [M, K] x [N, K], got {tuple(xq.shape)}, {tuple(wq.shape)}")
    m, k = xq.shape
    n = wq.shape[0]
    if xq.stride(1) != 1 or wq.stride(1) != 1 or k % 16:
        raise ValueError("fp8_gemm: contiguous last dims and K a multiple of 16")
    if xs.numel() != m or ws.numel() != n or not (xs.is_contiguous() and ws.is_contiguous()):
        shapes = f"{tuple(xs.shape)}, {tuple(ws.shape)}"
        raise ValueError(f"fp8_gemm: contiguous scales [M, 1] and [1, N], got {shapes}")
    if m == 0:  # no rows: nothing to launch (a grid of 0 programs is an error)
        return torch.empty((0, n), dtype=torch.bfloat16, device=xq.device)
    cfg = config or config_for(m, n, k) or default_config(m, n, k)
    if cfg.split_k == 1:
        y = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    else:
        y = torch.zeros((m, n), dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _fp8_gemm_kernel[grid](
        xq, wq, xs, ws, y, m, n, k, xq.stride(0), wq.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        PRECISE=cfg.precise, num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return y if cfg.split_k == 1 else y.to(torch.bfloat16)
