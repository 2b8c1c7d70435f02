"""int8 -> fp32 and the FMA into the accumulator: shared by the pointer and the TMA GEMVs."""

from __future__ import annotations

import triton
import triton.language as tl

# _dequant's e4m3 weights read by their bits are each the weight times 2**-120
E4M3_UNSCALE = tl.constexpr(2.0**120)


@triton.jit
def _dequant(w, MAGIC: tl.constexpr):
    """int8 or e4m3 -> fp32. MAGIC, int8: 2**23 + (w + 128) built in the float's bits, minus
    2**23 + 128: integer/FADD ops at full rate instead of I2F, whose quarter rate on sm_90
    (16/clk/SM, ~4.2e12/s on an H200) is as slow as streaming the int8 bytes from HBM.
    MAGIC, e4m3: its sign to bit 31, its exponent and mantissa to bits 20..26: the weight
    times 2**-120 (E4M3_UNSCALE; a subnormal e4m3 lands on an fp32 subnormal), by two
    integer ops instead of two conversions at quarter rate (e4m3 -> f16 -> f32); the
    kernel multiplies its sums back. Off: the plain conversion, exact either way."""
    if MAGIC:
        if w.dtype == tl.float8e4nv:
            b = w.to(tl.int8, bitcast=True).to(tl.int32)  # sign-extended: bit 31 is the sign
            bits = (b & -2147483648) | ((b << 20) & 0x07F00000)
            return bits.to(tl.float32, bitcast=True)
        else:
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
