"""int8 -> fp32 and the FMA into the accumulator: shared by the pointer and the TMA GEMVs."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dequant(w, MAGIC: tl.constexpr):
    """int8 (or, MAGIC off, e4m3) -> exact fp32. MAGIC (int8 only): 2**23 + (w + 128) built
    in the float's bits, minus 2**23 + 128: integer/FADD ops at full rate instead of I2F,
    whose quarter rate on sm_90 (16/clk/SM, ~4.2e12/s on an H200) is as slow as streaming
    the int8 bytes from HBM."""
    if MAGIC:
        bits = w.to(tl.int32) + 0x4B000080
        return bits.to(tl.float32, bitcast=True) - 8388736.0
    else:
        return w.to(tl.float32)


@triton.jit
def _fma(acc, w, x, MAGIC: tl.constexpr, REDUCE_EACH: tl.constexpr):
    """acc + w * x: element-wise into a [BLOCK_N, BLOCK_K] tile, or each chunk's row sums."""
    prod = _dequant(w, MAGIC) * x.to(tl.float32)[None, :]
    # one return, and a statement-if: the frontend builds the code after a constexpr-if's
    # return as well, so the two shapes met in one expression
    if REDUCE_EACH:  # noqa: SIM108
        out = acc + tl.sum(prod, axis=1)
    else:
        out = acc + prod
    return out
