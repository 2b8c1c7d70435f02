"""FlashInfer feasibility on the GPU host, in one call: import, JIT, one ragged prefill.

    python benchmarks/flashinfer_smoke.py [--lens 300 200] [--kernel fa2 auto fa3]

OmniVoice's attention shape: rows of different lengths packed end to end, non-causal
within a row, 16 query / 8 KV heads, head_dim 128, bf16. For each FlashInfer kernel family
asked for: plan + first run (which JIT-compiles the kernel with nvcc on a cold cache),
a check against torch SDPA per row, then the warm time of one run. The JIT cache lives
under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (default: $HOME).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
import torch.nn.functional as F

HEADS_Q, HEADS_KV, HEAD_DIM = 16, 8, 128


def reference(q, k, v, indptr: list[int]) -> torch.Tensor:
    outs = []
    for a, b in itertools.pairwise(indptr):
        qkv = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(*qkv, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def timed(fn, reps: int = 1) -> tuple[object, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", type=int, nargs="+", default=[300, 200])
    ap.add_argument("--kernel", nargs="+", default=["fa2", "auto"])
    args = ap.parse_args()
    t0 = time.perf_counter()
    import flashinfer

    print(f"flashinfer {flashinfer.__version__} imported in {time.perf_counter() - t0:.1f}s")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    from flashinfer.jit import env as jit_env

    print(f"JIT cache: {jit_env.FLASHINFER_JIT_DIR}")
    print(f"FLASHINFER_WORKSPACE_BASE={os.environ.get('FLASHINFER_WORKSPACE_BASE', '(unset)')}")

    torch.manual_seed(0)
    indptr = [0, *itertools.accumulate(args.lens)]
    n = indptr[-1]
    q, k, v = (
        torch.randn(n, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for h in (HEADS_Q, HEADS_KV, HEADS_KV)
    )
    want = reference(q, k, v, indptr).float()
    _, sdpa_s = timed(lambda: reference(q, k, v, indptr), reps=20)
    print(f"torch SDPA per row: {sdpa_s * 1e6:.1f} us")
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    indptr_t = torch.tensor(indptr, dtype=torch.int32)
    for kernel in args.kernel:
        try:
            wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                workspace, "NHD", backend=kernel
            )

            def plan(w=wrapper) -> None:
                w.plan(
                    indptr_t, indptr_t, HEADS_Q, HEADS_KV, HEAD_DIM, causal=False,
                    q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                )  # fmt: skip

            t0 = time.perf_counter()
            plan()
            got, _ = timed(lambda w=wrapper: w.run(q, k, v))
            first_s = time.perf_counter() - t0
            _, run_s = timed(lambda w=wrapper: w.run(q, k, v), reps=50)
            _, plan_s = timed(plan, reps=5)
        except Exception as exc:  # one kernel family failing must not hide the others
            print(f"[{kernel}] FAILED: {type(exc).__name__}: {exc}")
            continue
        err = float((got.float() - want).abs().max())
        ok = err < 2e-2  # bf16 outputs of unit-variance inputs: a few ulps of ~1
        print(
            f"[{kernel}] plan+JIT+first run {first_s:.1f}s | warm run {run_s * 1e6:.1f} us | "
            f"re-plan {plan_s * 1e6:.0f} us | max|diff| vs SDPA {err:.2e} {'OK' if ok else 'BAD'}"
        )


if __name__ == "__main__":
    main()
