"""The weight-only GEMVs' shared epilogue: per-channel scale and the split-K reduction.

int8_gemv (pointer and TMA kernels) and int6_gemv differ only in how they load and unpack
weights; once a program has its fp32 partial dot products, all finish the same way
(`store_scaled`), cut K the same way (`split_k_plan`) and draw their split-K buffers from one
semaphore pool (`split_k_buffers`). Like the kernel modules, this
one imports Triton: the package's __init__ loads it only on first use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv

# One pool per device for every split-K GEMV: each launch leaves its counters at zero.
SEMAPHORES: dict[str, torch.Tensor] = {}


@triton.jit
def store_scaled(
    part, scale_ptr, out_ptr, part_ptr, sem_ptr, offs_n, n_mask, pid_n, pid_k, N,
    BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, res_ptr=None, HAS_RES: tl.constexpr = False,
):  # fmt: skip
    """The per-channel scale, applied once per output; with split-K, the last program of
    each row block (counted with an atomic) sums the partials and re-arms the semaphore.
    HAS_RES: the output is res + the scaled sum, added in fp32 and rounded once (the
    residual add of a decoder block, without a kernel of its own)."""
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if SPLIT_K == 1:
        y = part * scale
        if HAS_RES:
            y += tl.load(res_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(part_ptr + pid_k * N + offs_n, part, mask=n_mask)
        # all threads' partial stores precede the release below (bar.sync + acq_rel atomic)
        tl.debug_barrier()
        done = tl.atomic_add(sem_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # fixed order: the result does not depend on who is last
                total += tl.load(
                    part_ptr + s * N + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg"
                )
            y = total * scale
            if HAS_RES:
                y += tl.load(res_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(sem_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # re-arm for replay


def split_k_semaphores(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` zeroed int32 counters on `device`, shared by all split-K launches there
    (allocated on the first call: warm up before CUDA-graph capture)."""
    key = str(device)
    sem = SEMAPHORES.get(key)
    if sem is None or sem.numel() < n:
        # zeros once; every split-K launch leaves them at zero again
        sem = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        SEMAPHORES[key] = sem
    return sem


def split_k_plan(length: int, block: int, split_k: int) -> tuple[int, int]:
    """(splits, elements per split) for a reduction of `length` in chunks of `block`: at most
    `split_k` splits of whole chunks, none of them empty."""
    split_k = max(1, min(split_k, cdiv(length, block)))
    per_split = cdiv(cdiv(length, block), split_k) * block
    return cdiv(length, per_split), per_split


def split_k_buffers(
    out: torch.Tensor, split_k: int, n: int, n_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [split_k, n], semaphores) for a split-K launch; with one split the
    kernel reads neither, and `out` stands in for both."""
    if split_k == 1:
        return out, out
    part = torch.empty((split_k, n), dtype=torch.float32, device=out.device)
    return part, split_k_semaphores(out.device, n_blocks)
