"""Correctness of the Rumik decode kernels (techniques/rumik/kernels) against torch references.

Without CUDA the kernels run in Triton's CPU interpreter: TRITON_INTERPRET=1 is set only while
this module imports (reloads) the kernel modules - @triton.jit picks interpreter or compiler at
decoration time - and while its own tests run (module fixture), then restored, so it does not
leak into other test modules. Shapes are small there (the interpreter is slow); the same tests
run compiled on a GPU, and the `gpu`-marked ones add real shapes, CUDA graphs and PDL.

Notes on the interpreter: it rounds fp32 -> bf16 by truncation (the GPU rounds to nearest), so
bf16 checks use relative-error thresholds ~1e-2, and fp32 inputs are used where exactness
matters.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kernel_compile
import pytest
import torch
from conftest import require_or_skip

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# The serving decoder's attention splitting in the tests that serve or step several rows:
# its default on a GPU; unsplit in the interpreter, where "auto" runs up to 16 programs a
# row and head plus a merge, each interpreted in Python (87% of the chunked server test's
# 541 s). Split against unsplit has its own test, interpreted too.
SPLITS: int | str = "auto" if CUDA else 1
_KERNELS = "orchestrate.techniques.rumik.kernels."
_ENV_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton decides interpreter-or-compiler when a function is decorated, its own library
# functions included, so without CUDA the interpreter must be on before triton's first import.
# If something imported triton earlier, run this file again in a fresh interpreted process.
IN_PROCESS = CUDA or _ENV_INTERPRET or "triton" not in sys.modules


@contextlib.contextmanager
def _interpreter(on: bool) -> Iterator[None]:
    old = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _load(name: str, package: str = _KERNELS) -> object:
    full = package + name
    if full in sys.modules and not CUDA:
        return importlib.reload(sys.modules[full])  # re-decorate as interpreted kernels
    return importlib.import_module(full)


with _interpreter(not CUDA and IN_PROCESS):
    require_or_skip("triton", gpu=True)  # on a CUDA host, or in CI: a failure
    if IN_PROCESS:
        # the shared epilogue first: the GEMVs import its kernel function when they load
        # fp8_rows before rope_norm and swiglu, which import its row quantizer
        ep, fq, gemv, attn, battn, samp, rn, g6, sw, fg, ra, f8g = (_load(n) for n in (
            "epilogue", "fp8_rows", "int8_gemv", "decode_attention", "batched_attention",
            "sampler", "rope_norm", "int6_gemv", "swiglu", "fused_gemv", "ring_attention",
            "fp8_gemm"))  # fmt: skip
        qkr = _load("qk_norm_rope", "orchestrate.techniques.omnivoice.kernels.")
        sg = _load("small_gemm", "orchestrate.techniques.omnivoice.kernels.")
    else:  # only the subprocess test below runs; names still needed at collection
        ep = importlib.import_module(_KERNELS + "epilogue")
        gemv = importlib.import_module(_KERNELS + "int8_gemv")
        g6 = importlib.import_module(_KERNELS + "int6_gemv")


# Every interpreted launch of this file's tests, compiled for sm_90 by the last test
# (kernel_compile.py says why).
LAUNCHES: list[dict] = []


@pytest.fixture(autouse=True, scope="module")
def _interpret_while_testing() -> Iterator[None]:
    with _interpreter(not CUDA):
        if CUDA or not IN_PROCESS:
            yield
            return
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def recording(self: object, *args: object, grid: object, warmup: bool, **kw: object):
            LAUNCHES.append(kernel_compile.describe(self, args, kw))
            return run(self, *args, grid=grid, warmup=warmup, **kw)

        InterpretedFunction.run = recording  # type: ignore[method-assign]
        try:
            yield
        finally:
            InterpretedFunction.run = run  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Each test's random inputs from one seed: a tolerance checked on random values must
    not pass or fail with the tests that ran before it."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _only_in_process(request: pytest.FixtureRequest) -> None:
    if not IN_PROCESS and request.node.name != "test_interpreted_subprocess":
        pytest.skip("runs inside test_interpreted_subprocess")


@pytest.mark.skipif(IN_PROCESS, reason="kernels already run in this process")
def test_interpreted_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # A bound, not a measure: the interpreter took 9 CPU minutes on a 2-core AVX2 machine and
    # ran past 600 s of wall time in CI beside the rest of the suite. As the file grew it
    # passed 1,500 s and then 2,400 s there (two clean-clone CI runs on 2026-12-07, on a
    # machine running the whole suite at about half its usual speed). Since the serving
    # tests run unsplit here (SPLITS) the file's tests sum to about 820 s under the
    # interpreter, from about 1,650 (pytest --durations, quiet 2-core machine); this bound
    # only keeps a hung child from holding CI.
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-rs", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=2400)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-2000:]
    # Exit 0 is also what a child that skipped everything returns: count what it ran. Every
    # collected test passed, except GPU ones and this one (already in its own process).
    collected = int(re.search(r"collected (\d+) items", out)[1])  # type: ignore[index]
    passed = int(re.search(r"(\d+) passed", out)[1])  # type: ignore[index]
    skips = [(int(n), why) for n, why in re.findall(r"SKIPPED \[(\d+)\] \S+:\d+: (.*)", out)]
    allowed = ("needs a CUDA GPU", "kernels already run in this process")
    assert all(why.startswith(allowed) for _, why in skips), skips
    assert passed + sum(n for n, _ in skips) == collected, out[-3000:]
    assert passed >= 100, out[-3000:]  # this file's CPU tests: 102 when written


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1.5e-2


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Fresh random values, never all zero (offset away from 0 so no row degenerates)."""
    x = torch.randn(*shape, device=DEVICE) * scale
    return (x + 0.01 * torch.sign(x)).to(dtype)


def dev_int(value: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([value], dtype=dtype, device=DEVICE)


def gpu(test: Any) -> Any:
    """Both halves of a GPU test in one decorator: the `gpu` marker, which `pytest -m gpu`
    selects on the device, and the skip where there is no CUDA. With the skip alone a test
    is silently left out of every `-m gpu` run on the H200."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(test))


# --------------------------------------------------------------------------- INT8 GEMV


def test_quantize_int8_bounds_and_zero_row() -> None:
    w = randn(24, 160)
    w[3] = 0
    q, scale = gemv.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (24,)
    assert int(q.abs().max()) <= 127 and bool((q[3] == 0).all()) and float(scale[3]) == 1.0
    err = (gemv.dequantize_int8(q, scale, torch.float32) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())  # round to nearest: half a step


GEMV_CASES = [
    (64, 256, gemv.GemvConfig(16, 64)),  # even: unmasked loads
    (72, 200, gemv.GemvConfig(16, 64)),  # ragged N and K: masked loads
    (64, 512, gemv.GemvConfig(8, 64, split_k=4)),  # split-K, even
    (40, 300, gemv.GemvConfig(8, 64, split_k=3)),  # split-K, ragged
    (64, 512, gemv.GemvConfig(16, 64, prefetch=True)),  # register double-buffering, even
    (40, 300, gemv.GemvConfig(8, 64, split_k=2, prefetch=True)),  # prefetch + split-K, ragged
    (72, 200, gemv.GemvConfig(16, 64, prefetch=True, magic=True)),  # bit-trick int8 -> fp32
    (64, 512, gemv.GemvConfig(8, 64, split_k=4, magic=True)),
    (64, 300, gemv.GemvConfig(16, 64, magic=True)),  # whole N blocks, ragged K: masked tail
    (40, 300, gemv.GemvConfig(8, 64, split_k=2)),  # the tail in the last split only
    # the first weight chunk loaded before the PDL wait: even, ragged, tail, split
    (64, 256, gemv.GemvConfig(16, 64, preload=True)),
    (72, 200, gemv.GemvConfig(16, 64, preload=True)),
    (64, 300, gemv.GemvConfig(16, 64, preload=True, magic=True)),
    (40, 300, gemv.GemvConfig(8, 64, split_k=2, preload=True)),
    # each chunk reduced into a [BLOCK_N] accumulator
    (64, 300, gemv.GemvConfig(16, 64, reduce_each=True)),
    (40, 300, gemv.GemvConfig(8, 64, split_k=3, reduce_each=True)),
    (40, 300, gemv.GemvConfig(8, 64, split_k=2, reduce_each=True, preload=True)),
    (64, 512, gemv.GemvConfig(16, 64, prefetch=True, reduce_each=True)),
    # weight tiles by the TMA (M=1; zero-filled past N and K): even, ragged, split + ragged
    (64, 256, gemv.GemvConfig(16, 64, num_stages=3, tma=True)),
    (72, 208, gemv.GemvConfig(16, 64, num_stages=3, magic=True, tma=True)),
    (40, 400, gemv.GemvConfig(8, 64, split_k=3, num_stages=2, tma=True)),
]


# Rows and input dtype for each GEMV case: the whole grid on the GPU. In the CPU interpreter
# (about 4 s a case; 126 cases were half the file's 9 CPU minutes) each case runs at two of
# four points, alternating: M=1 in fp32 with M=2 in bf16, or M=1 in bf16 with M=4 in fp32.
# So every case runs in both dtypes, on the one-row and a multi-row path, and every point
# runs on half the cases.
M_DTYPES = [(m, dtype) for m in (1, 2, 4) for dtype in (torch.float32, torch.bfloat16)]
CPU_POINTS = [(1, torch.float32), (1, torch.bfloat16), (2, torch.bfloat16), (4, torch.float32)]
GEMV_GRID = (
    [(*point, *case) for case in GEMV_CASES for point in M_DTYPES]
    if CUDA
    else [(*CPU_POINTS[(i + j) % 4], *case) for i, case in enumerate(GEMV_CASES) for j in (0, 2)]
)


@pytest.mark.parametrize("m,dtype,n,k,cfg", GEMV_GRID)
def test_int8_linear_matches_reference(
    n: int, k: int, cfg: object, m: int, dtype: torch.dtype
) -> None:
    q, scale = gemv.quantize_int8(randn(n, k))
    x = randn(m, k, dtype=dtype)
    out = gemv.int8_linear(x, q, scale, config=cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, gemv.int8_linear_ref(x, q, scale)) < tol(dtype)
    w = gemv.dequantize_int8(q, scale, torch.float32)
    assert rel_err(out, torch.nn.functional.linear(x.float(), w)) < tol(dtype)


def test_int8_linear_split_k_is_deterministic_and_rearms() -> None:
    q, scale = gemv.quantize_int8(randn(48, 384))
    x = randn(1, 384, dtype=torch.bfloat16)
    cfg = gemv.GemvConfig(16, 64, split_k=3)
    first = gemv.int8_linear(x, q, scale, config=cfg)
    for _ in range(2):  # as graph replays would
        assert torch.equal(gemv.int8_linear(x, q, scale, config=cfg), first)
    assert int(ep.SEMAPHORES[str(x.device)].abs().sum()) == 0


def test_int8_linear_vector_input_and_default_config() -> None:
    q, scale = gemv.quantize_int8(randn(32, 128))
    x = randn(128, dtype=torch.bfloat16)
    out = gemv.int8_linear(x, q, scale)
    assert out.shape == (32,)
    assert rel_err(out, gemv.int8_linear_ref(x[None], q, scale)[0]) < tol(torch.bfloat16)


@pytest.mark.skipif(
    CUDA,
    reason="compiled, the last reduction follows the register layout: "
    "test_gpu_tma_gemv_real_shapes_in_graph_with_pdl bounds the difference",
)
@pytest.mark.parametrize("n,k,split_k", [(64, 256, 1), (72, 208, 1), (40, 400, 3)])
def test_int8_tma_gemv_equals_the_pointer_kernel(n: int, k: int, split_k: int) -> None:
    """The same products summed in the same order: under the interpreter the TMA kernel's
    output is the pointer kernel's, bit for bit, whatever the stages (the zero-filled tile
    past K adds zeros)."""
    q, scale = gemv.quantize_int8(randn(n, k))
    x = randn(1, k, dtype=torch.bfloat16)
    plain = gemv.int8_linear(x, q, scale, config=gemv.GemvConfig(16, 64, split_k=split_k))
    for stages in (1, 3):
        cfg = gemv.GemvConfig(16, 64, split_k=split_k, num_stages=stages, tma=True)
        assert torch.equal(gemv.int8_linear(x, q, scale, config=cfg), plain)


def test_int8_tma_gemv_refuses_what_the_tma_cannot_fetch() -> None:
    with pytest.raises(ValueError, match="tma pipelines its own loads"):
        gemv.GemvConfig(16, 64, prefetch=True, tma=True)
    q, scale = gemv.quantize_int8(randn(16, 520))
    with pytest.raises(ValueError, match="at most 256 a side"):
        gemv.int8_linear(randn(1, 520), q, scale, config=gemv.GemvConfig(16, 512, tma=True))
    q, scale = gemv.quantize_int8(randn(16, 72))  # 72-byte rows: not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemv.int8_linear(randn(1, 72), q, scale, config=gemv.GemvConfig(16, 64, tma=True))


def test_int8_linear_rejects_unsupported() -> None:
    q, scale = gemv.quantize_int8(randn(16, 64))
    with pytest.raises(ValueError, match=r"1\.\.4 rows"):
        gemv.int8_linear(randn(5, 64), q, scale)
    with pytest.raises(ValueError, match="K=32"):
        gemv.int8_linear(randn(1, 32), q, scale)
    with pytest.raises(ValueError, match="dtype"):
        gemv.int8_linear(torch.ones(1, 64, dtype=torch.int32, device=DEVICE), q, scale)
    with pytest.raises(ValueError, match="int8"):
        gemv.int8_linear(randn(1, 64), q.float(), scale)
    with pytest.raises(ValueError, match="preload and prefetch"):
        gemv.GemvConfig(16, 64, prefetch=True, preload=True)
    q100, s100 = gemv.quantize_int8(randn(64, 100))  # splits of 64 and 36: no whole first chunk
    with pytest.raises(ValueError, match="whole first chunks"):
        gemv.int8_linear(randn(1, 100), q100, s100, config=gemv.GemvConfig(16, 64, split_k=2,
                                                                         preload=True))  # fmt: skip


FP8_GEMV_CASES = [  # (m, n, k, cfg): one row and the small-m path; even, ragged, split-K
    (1, 64, 256, gemv.GemvConfig(16, 64)),
    (1, 72, 200, gemv.GemvConfig(16, 64, magic=True)),  # magic is int8's: turned off
    (1, 40, 300, gemv.GemvConfig(8, 64, split_k=3, prefetch=True)),
    (3, 48, 160, gemv.GemvConfig(16, 64)),
]


@pytest.mark.parametrize("m,n,k,cfg", FP8_GEMV_CASES)
def test_the_gemv_reads_e4m3_weights_exactly(m: int, n: int, k: int, cfg: object) -> None:
    """fp8_projections' one-row path: e4m3 weights with a scale per channel, x unquantized.
    The kernel's y is x @ (q * scale).T with each weight converted exactly: within fp32
    summation order of the dequantized product, and far from int8-magic's misreading of
    the same bytes."""
    from orchestrate.techniques.rumik.fp8_projections import Fp8Weight

    w = Fp8Weight.of(randn(n, k) * torch.linspace(0.01, 3, n, device=DEVICE)[:, None])
    x = randn(m, k, dtype=torch.bfloat16)
    out = gemv.int8_linear(x, w.q, w.scale, config=cfg)
    ref = (x.float() @ w.q.float().t()) * w.scale
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < tol(torch.bfloat16)
    as_int8 = gemv.int8_linear(x, w.q.view(torch.int8), w.scale, config=cfg)
    assert rel_err(as_int8, ref) > 0.5  # the same bytes read as int8 are another matrix


@pytest.mark.parametrize("magic", [False, True])
@pytest.mark.parametrize("split_k", [1, 4])
def test_every_e4m3_code_is_read_as_its_value(magic: bool, split_k: int) -> None:
    """Each of the 254 finite e4m3 codes, subnormals and both zeros among them, read exactly
    (a config with magic on too: int8's trick, turned off for e4m3). Sums of e4m3 values from
    2**-9 to 448 stay exact in fp32; a row of subnormals alone would be lost by a
    flush-to-zero. Reading e4m3 by its bits (two integer ops, the sums scaled back by
    2**120) was tried and measured 1.070x slower than the conversion on an H100
    (benchmarks/h100/serving/fp8-gemm-bits.json), so it is not here."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    finite = codes[values.isfinite()]
    q = torch.zeros(4, 256, dtype=torch.uint8)
    q[0, : len(finite)] = finite  # every finite code
    q[1, :7], q[2, :7] = codes[1:8], codes[129:136]  # the positive, then negative subnormals
    q[3, : len(finite)] = finite.flip(0)
    q = q.view(torch.float8_e4m3fn).to(DEVICE)
    x = torch.ones(1, 256, device=DEVICE)
    cfg = gemv.GemvConfig(16, 64, magic=magic, split_k=split_k)
    out = gemv.int8_linear(x, q, torch.ones(4, device=DEVICE), config=cfg).double().cpu()[0]
    ref = q.float().double().cpu().sum(1)
    assert out[1] == ref[1] == 28 * 2.0**-9 and out[2] == ref[2] == -28 * 2.0**-9
    assert torch.equal(out[0], ref[0]) and torch.equal(out[3], ref[3])


@pytest.mark.parametrize("n,k,cfg", [(c[1], c[2], c[3]) for c in FP8_GEMV_CASES[:3]])
def test_the_gemv_gives_fp8_projections_products_at_one_row(n: int, k: int, cfg: object) -> None:
    """An e4m3 x row with its scale against e4m3 weights with theirs: what fp8_matmul
    emulates (float32 products of the dequantized operands), in bf16, split-K or not."""
    from orchestrate.techniques.rumik.fp8_projections import Fp8Weight, fp8_matmul, quantize_rows

    w = Fp8Weight.of(randn(n, k))
    xq, xs = quantize_rows(randn(1, k, scale=5.0))
    out = gemv.int8_linear(xq, w.q, w.scale, config=cfg, x_scale=xs)
    ref = fp8_matmul(xq, xs, w, emulate=True, dtype=torch.float32)
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < tol(torch.bfloat16)
    unscaled = gemv.int8_linear(xq, w.q, w.scale, config=cfg, x_scale=torch.ones_like(xs))
    assert rel_err(unscaled * xs, ref) < tol(torch.bfloat16)  # the scale is applied, once
    assert rel_err(unscaled, ref) > 0.5


@pytest.mark.parametrize("n,k,cfg", [(c[1], c[2], c[3]) for c in FP8_GEMV_CASES[:3]])
def test_the_gemvs_residual_epilogue_adds_its_input_once(n: int, k: int, cfg: object) -> None:
    """`residual`: y = residual + x @ W.T, summed in fp32 and rounded once, split-K or not
    (fp8_projections' one-row residual adds); int8 weights the same."""
    from orchestrate.techniques.rumik.fp8_projections import Fp8Weight, fp8_matmul, quantize_rows

    w = Fp8Weight.of(randn(n, k))
    xq, xs = quantize_rows(randn(1, k, scale=5.0))
    res = randn(n, dtype=torch.bfloat16, scale=200.0)  # beside products of ~5 * sqrt(k)
    out = gemv.int8_linear(xq, w.q, w.scale, config=cfg, x_scale=xs, residual=res)
    ref = res.float() + fp8_matmul(xq, xs, w, emulate=True, dtype=torch.float32)[0]
    assert out.shape == (1, n) and rel_err(out[0], ref) < tol(torch.bfloat16)
    plain = gemv.int8_linear(xq, w.q, w.scale, config=cfg, x_scale=xs)
    assert rel_err(plain[0], ref) > 0.5  # without it, the residual is missing
    q, scale = gemv.quantize_int8(randn(n, k))
    x = randn(1, k, dtype=torch.bfloat16)
    out8 = gemv.int8_linear(x, q, scale, config=cfg, residual=res)
    ref8 = res.float() + (x.float() @ q.float().t()) * scale.float()
    assert rel_err(out8[0], ref8[0]) < tol(torch.bfloat16)


def test_the_gemv_refuses_a_residual_it_cannot_add() -> None:
    q, scale = gemv.quantize_int8(randn(64, 256))
    x = randn(2, 256, dtype=torch.bfloat16)
    res = randn(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual goes with one row"):
        gemv.int8_linear(x, q, scale, residual=res)  # two rows
    with pytest.raises(ValueError, match="residual goes with one row"):
        gemv.int8_linear(x[:1], q, scale, residual=res[:32])
    with pytest.raises(ValueError, match="dtype"):
        gemv.int8_linear(x[:1], q, scale, residual=res.float())
    with pytest.raises(ValueError, match="no residual"):
        gemv.int8_linear(x[:1], q, scale, config=gemv.GemvConfig(16, 64, tma=True), residual=res)


def test_the_gemv_refuses_what_its_fp8_paths_do_not_read() -> None:
    from orchestrate.techniques.rumik.fp8_projections import Fp8Weight, quantize_rows

    w = Fp8Weight.of(randn(64, 256))
    xq, xs = quantize_rows(randn(2, 256))
    with pytest.raises(ValueError, match="TMA kernel reads int8 weights"):
        gemv.int8_linear(randn(1, 256), w.q, w.scale, config=gemv.GemvConfig(16, 64, tma=True))
    with pytest.raises(ValueError, match="one row of x"):
        gemv.int8_linear(xq, w.q, w.scale, x_scale=xs[:1])
    with pytest.raises(ValueError, match="x_scale goes with one row of x and is one value"):
        gemv.int8_linear(xq[:1], w.q, w.scale, x_scale=xs.reshape(2))
    with pytest.raises(ValueError, match="dtype"):  # an e4m3 x without its scale
        gemv.int8_linear(xq[:1], w.q, w.scale)


# --------------------------------------------------------------------------- INT6 GEMV


def test_quantize_int6_packing_round_trip_and_bounds() -> None:
    w = randn(24, 160)
    w[3] = 0
    packed, scale = g6.quantize_int6(w)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 120)  # 4 weights in 3 bytes
    q = g6.unpack_int6(packed)
    assert int(q.abs().max()) <= 31 and bool((q[3] == 0).all()) and float(scale[3]) == 1.0
    ref = torch.round(w.float() / scale[:, None]).clamp(-31, 31).to(torch.int8)
    assert torch.equal(q, ref)  # the packing is lossless for the 6-bit codes
    err = (g6.dequantize_int6(packed, scale, torch.float32) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())
    with pytest.raises(ValueError, match="multiple of 4"):
        g6.quantize_int6(randn(4, 10))


INT6_CASES = [
    (64, 256, g6.Int6Config(16, 16)),  # even: whole chunks
    (72, 200, g6.Int6Config(16, 16)),  # ragged N and K/4: masked loads
    (64, 512, g6.Int6Config(8, 16, split_k=4)),  # split-K, even
    (40, 304, g6.Int6Config(8, 16, split_k=3)),  # split-K, ragged
    (64, 256, None),  # default config
]


@pytest.mark.parametrize("n,k,cfg", INT6_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int6_linear_matches_reference(n: int, k: int, cfg: object, dtype: torch.dtype) -> None:
    packed, scale = g6.quantize_int6(randn(n, k))
    x = randn(1, k, dtype=dtype)
    out = g6.int6_linear(x, packed, scale, config=cfg)
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_err(out, g6.int6_linear_ref(x, packed, scale)) < tol(dtype)
    w = g6.dequantize_int6(packed, scale, torch.float32)
    assert rel_err(out, torch.nn.functional.linear(x.float(), w)) < tol(dtype)


def test_int6_linear_split_k_deterministic_and_rejects_unsupported() -> None:
    packed, scale = g6.quantize_int6(randn(48, 384))
    x = randn(384, dtype=torch.bfloat16)
    cfg = g6.Int6Config(16, 16, split_k=3)
    first = g6.int6_linear(x, packed, scale, config=cfg)
    assert first.shape == (48,)
    for _ in range(2):  # as graph replays would
        assert torch.equal(g6.int6_linear(x, packed, scale, config=cfg), first)
    assert int(ep.SEMAPHORES[str(x.device)].abs().sum()) == 0
    with pytest.raises(ValueError, match="one row"):
        g6.int6_linear(randn(2, 384), packed, scale)
    with pytest.raises(ValueError, match="K=32"):
        g6.int6_linear(randn(1, 32), packed, scale)
    with pytest.raises(ValueError, match="uint8"):
        g6.int6_linear(randn(1, 384), packed.to(torch.int8), scale)


# --------------------------------------------------------------------------- decode attention


def _kv(s_max: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = randn(1, 4, s_max, 128, dtype=dtype), randn(1, 4, s_max, 128, dtype=dtype)
    k[:, :, length:] = float("nan")  # poison: any read beyond the length shows up
    v[:, :, length:] = 1e30
    return k, v


ATTN_CASES = [
    (1, 0, 4),  # only the current token
    (100, 0, 4),
    (256, 0, 4),  # full cache
    (200, 64, 4),  # sliding window inside the length
    (50, 64, 4),  # window longer than the length: no effect
    (37, 0, 1),  # single-pass variant
    (150, 16, 8),  # window shorter than one split
]


@pytest.mark.parametrize("length,window,splits", ATTN_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_reference(
    length: int, window: int, splits: int, dtype: torch.dtype
) -> None:
    q = randn(1, 16, 128, dtype=dtype)
    k, v = _kv(256, length, dtype)
    out = attn.decode_attention(q, k, v, dev_int(length), window=window, num_splits=splits,
                                block_s=16)  # fmt: skip
    ref = attn.decode_attention_ref(q, k, v, length, window=window)
    assert out.shape == q.shape and not bool(out.isnan().any())
    assert rel_err(out, ref) < tol(dtype)


def test_decode_attention_window_equals_slice() -> None:
    q = randn(1, 16, 128)
    k, v = _kv(128, 128, torch.float32)
    windowed = attn.decode_attention(q, k, v, dev_int(120), window=32, block_s=16)
    sliced = attn.decode_attention(q, k[:, :, 88:120], v[:, :, 88:120], dev_int(32), block_s=16)
    assert rel_err(windowed, sliced) < 1e-5


@pytest.mark.parametrize("splits", [4, 1], ids=["split", "single-pass"])
def test_decode_attention_length_is_read_on_device(splits: int) -> None:
    """One launch configuration, lengths changed in device memory (as graph replays do).
    The output starts as NaN each time: length 0 must write its zeros, in both variants."""
    q = randn(16, 128)
    k, v = randn(4, 192, 128), randn(4, 192, 128)
    length = dev_int(0)
    out = torch.empty_like(q)
    for n in (0, 5, 64, 191):
        length.fill_(n)
        out.fill_(float("nan"))
        attn.decode_attention(q, k, v, length, out=out, num_splits=splits, block_s=16)
        if n:
            assert rel_err(out, attn.decode_attention_ref(q, k, v, n)) < 1e-5
        else:
            assert float(out.abs().max()) == 0.0


def test_decode_attention_gqa_groups() -> None:
    """Hq=8 over Hkv=2 (group 4) with a strided view of a larger cache."""
    q = randn(8, 128)
    big_k, big_v = randn(2, 96, 128), randn(2, 96, 128)
    k, v = big_k[:, :64], big_v[:, :64]
    out = attn.decode_attention(q, k, v, dev_int(50, torch.int64), num_splits=2, block_s=16)
    assert rel_err(out, attn.decode_attention_ref(q, k, v, 50)) < 1e-5


@pytest.mark.parametrize("length,window,splits", ATTN_CASES)
def test_decode_attention_length_offset(length: int, window: int, splits: int) -> None:
    """A position tensor plus length_offset=1 on the device is the length (what the decoder
    passes instead of launching position + 1 for every layer)."""
    q = randn(1, 16, 128)
    k, v = _kv(256, length, torch.float32)
    kw = dict(window=window, num_splits=splits, block_s=16)
    offset = attn.decode_attention(q, k, v, dev_int(length - 1), length_offset=1, **kw)
    assert torch.equal(offset, attn.decode_attention(q, k, v, dev_int(length), **kw))
    assert rel_err(offset, attn.decode_attention_ref(q, k, v, length, window=window)) < 1e-5


def test_decode_attention_rejects_unsupported() -> None:
    q = randn(1, 16, 64)
    k = randn(1, 4, 32, 64)
    with pytest.raises(ValueError, match="head_dim must be 128"):
        attn.decode_attention(q, k, k, dev_int(4))
    q, k = randn(1, 16, 128), randn(1, 4, 32, 128)
    with pytest.raises(ValueError, match="length must be a one-element"):
        attn.decode_attention(q, k, k, 4)  # type: ignore[arg-type]
    huge = torch.zeros(1, 1, 1, 128, device=DEVICE).expand(1, 4, attn.MAX_SEQ + 1, 128)
    with pytest.raises(ValueError, match="S_max"):
        attn.decode_attention(q, huge, huge, dev_int(4))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attn.decode_attention(randn(1, 6, 128), k, k, dev_int(4))


# ------------------------------------------------------------ batched decode attention

# Rows of other lengths in one launch: empty, one position, ragged, a whole block, the cache.
ROW_LENGTHS = [0, 1, 37, 64, 100, 160]


@pytest.mark.parametrize("window,splits", [(0, 1), (48, 1), (0, 3), (48, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_attention_reads_each_rows_own_length(
    window: int, splits: int, dtype: torch.dtype
) -> None:
    """Hq=8 over Hkv=2 on strided row views of a larger cache; every row against the torch
    reference on its own slice, an empty row zeros, and each row bit-for-bit what the
    one-stream kernel gives it (the same inner loop over the same splits)."""
    b = len(ROW_LENGTHS)
    q = randn(b, 8, 128, dtype=dtype)
    big_k, big_v = randn(b, 2, 192, 128, dtype=dtype), randn(b, 2, 192, 128, dtype=dtype)
    k, v = big_k[:, :, :160], big_v[:, :, :160]
    lengths = torch.tensor(ROW_LENGTHS, device=DEVICE)
    kw = dict(window=window, num_splits=splits, block_s=16)
    out = battn.batched_decode_attention(q, k, v, lengths, **kw)
    ref = battn.batched_decode_attention_ref(q, k, v, ROW_LENGTHS, window=window)
    assert float(out[0].abs().max()) == 0.0
    for r in range(1, b):
        assert rel_err(out[r], ref[r]) < tol(dtype), r
        alone = attn.decode_attention(q[r], k[r], v[r], lengths[r : r + 1], **kw)
        assert torch.equal(out[r], alone), r
    # positions + 1 on the device is the lengths (what the batched step passes)
    positions = (lengths - 1).clamp_min(0)
    offset = battn.batched_decode_attention(q, k, v, positions, length_offset=1, **kw)
    assert torch.equal(offset[1:], out[1:])


def test_batched_decode_attention_rows_do_not_see_each_other() -> None:
    """A row's output does not change when the other rows' caches and lengths do."""
    q, k, v = randn(3, 16, 128), randn(3, 4, 64, 128), randn(3, 4, 64, 128)
    lengths = torch.tensor([20, 50, 64], device=DEVICE)
    before = battn.batched_decode_attention(q, k, v, lengths, block_s=16)
    k[0].normal_(), v[2].normal_()
    lengths[2] = 3
    after = battn.batched_decode_attention(q, k, v, lengths, block_s=16)
    assert torch.equal(before[1], after[1]) and not torch.equal(before[0], after[0])


@pytest.mark.parametrize("splits", [1, 3])
def test_batched_decode_attention_maps_queries_to_cache_rows(splits: int) -> None:
    """With `cache_rows`, query r reads cache row cache_rows[r] of a cache with more rows
    than queries: three queries share row 2 at lengths 5, 6 and 7 (a prompt's tokens in one
    step), one reads row 0 and one the last row at length 0 (zeros). Each is bit-for-bit
    the unmapped kernel over the gathered rows and matches the reference; FP8 caches too."""
    from orchestrate.techniques.rumik.fp8_projections import quantize_rows

    rows, lengths_list = [2, 2, 2, 0, 4], [5, 6, 7, 40, 0]
    q = randn(5, 8, 128)
    k, v = randn(5, 2, 64, 128), randn(5, 2, 64, 128)
    cache_rows = torch.tensor(rows, device=DEVICE)
    lengths = torch.tensor(lengths_list, device=DEVICE)
    kw = dict(window=4, num_splits=splits, block_s=16)
    out = battn.batched_decode_attention(q, k, v, lengths, cache_rows=cache_rows, **kw)
    gathered = battn.batched_decode_attention(q, k[cache_rows], v[cache_rows], lengths, **kw)
    ref = battn.batched_decode_attention_ref(q, k, v, lengths_list, window=4, cache_rows=rows)
    assert torch.equal(out, gathered)
    assert rel_err(out[:4], ref[:4]) < tol(torch.float32)
    assert float(out[4].abs().max()) == 0.0
    assert not torch.equal(out[0], out[1])  # one row, two lengths: two answers
    (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
    ks, vs = ks[..., 0].contiguous(), vs[..., 0].contiguous()
    scaled = dict(k_scale=ks, v_scale=vs)
    out8 = battn.batched_decode_attention(q, k8, v8, lengths, cache_rows=cache_rows, **kw,
                                          **scaled)  # fmt: skip
    ref8 = battn.batched_decode_attention_ref(q, k8, v8, lengths_list, window=4,
                                              cache_rows=rows, **scaled)  # fmt: skip
    assert rel_err(out8[:4], ref8[:4]) < tol(torch.float32)
    with pytest.raises(ValueError, match=r"cache_rows must be \[5\] int32 or int64"):
        battn.batched_decode_attention(q, k, v, lengths, cache_rows=cache_rows[:4])
    with pytest.raises(ValueError, match="5 query rows but caches of 4"):
        battn.batched_decode_attention(q, k[:4], v[:4], lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_attention_over_an_fp8_cache_is_attention_over_its_dequantized_values(
    dtype: torch.dtype,
) -> None:
    """An e4m3 cache with a scale per position and KV head: each row against the reference
    over the dequantized cache (the scales folded into scores and weights are the same
    sums), an empty row zeros, and the answer near the unquantized cache's, not equal."""
    from orchestrate.techniques.rumik.fp8_projections import quantize_rows

    b = len(ROW_LENGTHS)
    q = randn(b, 8, 128, dtype=dtype)
    k, v = randn(b, 2, 160, 128, dtype=dtype), randn(b, 2, 160, 128, dtype=dtype)
    (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
    ks, vs = ks[..., 0].contiguous(), vs[..., 0].contiguous()
    lengths = torch.tensor(ROW_LENGTHS, device=DEVICE)
    for window, splits in ((0, 1), (48, 3)):
        out = battn.batched_decode_attention(
            q, k8, v8, lengths, window=window, num_splits=splits, block_s=16,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip
        ref = battn.batched_decode_attention_ref(
            q, k8, v8, ROW_LENGTHS, window=window, k_scale=ks, v_scale=vs
        )
        exact = battn.batched_decode_attention_ref(q, k, v, ROW_LENGTHS, window=window)
        assert float(out[0].abs().max()) == 0.0
        for r in range(1, b):
            assert rel_err(out[r], ref[r]) < tol(dtype), (window, r)
            assert 0 < rel_err(out[r], exact[r]) < 0.1, (window, r)
    with pytest.raises(ValueError, match="give both k_scale and v_scale"):
        battn.batched_decode_attention(q, k8, v8, lengths, k_scale=ks)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        battn.batched_decode_attention(q, k8, v8, lengths, k_scale=ks[:, :, :64], v_scale=vs)
    with pytest.raises(ValueError, match="dtype must be one of"):
        battn.batched_decode_attention(q, k, v, lengths, k_scale=ks, v_scale=vs)


def test_the_int4_layout_packs_each_pair_into_a_byte_and_round_trips() -> None:
    """int4_cache.py's layout, in torch: byte j holds elements 2j (low nibble) and 2j + 1
    (high), offset by 8; a vector's largest |value| maps to +-7 exactly; -x packs to the
    negated integers; the round trip is within half a step of each vector's scale."""
    from orchestrate.techniques.rumik.kernels.int4_cache import (
        dequantize_int4,
        quantize_int4,
        unpack_int4,
    )

    x = torch.tensor([[7.0, -7.0, 3.0, 0.0], [0.5, 1.0, -0.25, 0.0]])
    packed, scale = quantize_int4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2)
    assert torch.equal(scale, torch.tensor([1.0, 1.0 / 7]))  # float32 scales
    assert packed[0].tolist() == [(7 + 8) | ((-7 + 8) << 4), (3 + 8) | (0 + 8) << 4]
    assert unpack_int4(packed)[0].tolist() == [7.0, -7.0, 3.0, 0.0]
    x = torch.randn(5, 3, 128)
    p, s = quantize_int4(x)
    n = unpack_int4(p)
    assert float(n.abs().amax(-1).min()) == 7.0 and float(n.min()) >= -7.0
    assert torch.equal(unpack_int4(quantize_int4(-x)[0]), -n)
    assert float(((dequantize_int4(p, s) - x).abs() / s[..., None]).max()) <= 0.5 + 1e-5
    with pytest.raises(ValueError, match="last dim must be even"):
        quantize_int4(torch.randn(3, 5))
    with pytest.raises(ValueError, match="a uint8 cache"):
        unpack_int4(torch.zeros(3, 4, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_attention_over_an_int4_cache_is_attention_over_its_dequantized_values(
    dtype: torch.dtype,
) -> None:
    """A packed INT4 cache (uint8, two values a byte) with a scale per position and KV
    head: each row against the reference over the dequantized cache, split and unsplit and
    through a row map; an empty row zeros; near the unquantized cache's answer, not equal
    (APPROXIMATE: 4 bits); a uint8 cache without scales or of the wrong width refused."""
    from orchestrate.techniques.rumik.kernels.int4_cache import quantize_int4

    b = len(ROW_LENGTHS)
    q = randn(b, 8, 128, dtype=dtype)
    k, v = randn(b, 2, 160, 128, dtype=dtype), randn(b, 2, 160, 128, dtype=dtype)
    (k4, ks), (v4, vs) = quantize_int4(k), quantize_int4(v)
    lengths = torch.tensor(ROW_LENGTHS, device=DEVICE)
    for window, splits in ((0, 1), (48, 3)):
        out = battn.batched_decode_attention(
            q, k4, v4, lengths, window=window, num_splits=splits, block_s=16,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip
        ref = battn.batched_decode_attention_ref(
            q, k4, v4, ROW_LENGTHS, window=window, k_scale=ks, v_scale=vs
        )
        exact = battn.batched_decode_attention_ref(q, k, v, ROW_LENGTHS, window=window)
        assert float(out[0].abs().max()) == 0.0
        for r in range(1, b):
            assert rel_err(out[r], ref[r]) < tol(dtype), (window, r)
            assert 0 < rel_err(out[r], exact[r]) < 0.3, (window, r)
    rows = [5, 5, 2]  # a row map: two queries over one cache row at two lengths
    mapped = battn.batched_decode_attention(
        q[:3], k4, v4, torch.tensor([160, 90, 37], device=DEVICE), block_s=32, k_scale=ks,
        v_scale=vs, cache_rows=torch.tensor(rows, device=DEVICE),
    )  # fmt: skip
    ref = battn.batched_decode_attention_ref(
        q[:3], k4, v4, [160, 90, 37], k_scale=ks, v_scale=vs, cache_rows=rows
    )
    assert rel_err(mapped, ref) < tol(dtype)
    with pytest.raises(ValueError, match="packed INT4.*needs k_scale and v_scale"):
        battn.batched_decode_attention(q, k4, v4, lengths)
    with pytest.raises(ValueError, match="hold 64 bytes a position"):
        battn.batched_decode_attention(q, k4[..., :32], v4[..., :32], lengths, k_scale=ks,
                                       v_scale=vs)  # fmt: skip


# cosine of a quantized cache's logits with the exact cache's, at least (every step, row)
KV_COSINE = {"fp8": 0.99, "int4": 0.99}


@pytest.mark.parametrize("kv", ["fp8", "int4"])
def test_a_quantized_cache_keeps_the_serving_steps_logits_near_the_exact_caches(kv: str) -> None:
    """BatchedDecoder with kv='fp8' or 'int4' teacher-forced beside kv='model' (triton
    attention, three rows, prompts past the sliding window): every step's logits keep a
    cosine above KV_COSINE with the exact cache's, and differ from them; the cache holds
    e4m3 (or packed uint8, two values a byte) and scales. With int4, the kernel glue (the
    rotary kernel packs what it writes) gives the torch glue's logits up to rounding order."""
    import torch.nn.functional as F

    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_decode import BatchedDecoder

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    long = " ".join(["A longer sentence, to reach well past the sliding window."] * 3)
    prompts = [model.encode_prompt(build_prompt(t, "Ira", "neutral")) for t in ["Hi.", long, "Ok."]]
    greedy = SamplingConfig(top_k=1)
    ids = [model.vocab.codebook_ids(i % 8) for i in range(4)]
    tokens = [[int(ids[i][3 * r + i]) for i in range(4)] for r in range(3)]
    runs = {}
    ways = [("exact", "model", "torch"), ("torch", kv, "torch"), ("triton", kv, "triton")]
    if kv == "fp8":  # its kernel glue's writes have their own tests; interpreted time is dear
        ways.pop()
    for name, cache, glue in ways:
        dec = BatchedDecoder(model, 3, 256, greedy, "triton", kv=cache, glue=glue,
                             attention_splits=SPLITS)  # fmt: skip
        with torch.inference_mode():
            runs[name] = dec.teacher_forced(prompts, tokens)
    if kv == "fp8":
        assert dec.k.dtype == torch.float8_e4m3fn and dec.k_scale.shape == dec.k.shape[:-1]
    else:
        assert dec.k.dtype == torch.uint8 and dec.k.shape[-1] * 2 == model.config.head_dim
        assert dec.k_scale.shape == dec.k.shape[:-1]
    worst = min(
        float(F.cosine_similarity(a, c, dim=-1).min())
        for (a, _), (c, _) in zip(runs["exact"], runs["torch"], strict=True)
    )
    assert worst > KV_COSINE[kv], worst
    print(f"kv {kv}: worst logit cosine against the exact cache {worst:.4f}")
    if kv == "int4":
        for (c, _), (t, _) in zip(runs["torch"], runs["triton"], strict=True):
            assert (F.cosine_similarity(c, t, dim=-1) > 0.999).all()
    pairs = zip(runs["exact"], runs["torch"], strict=True)
    assert any(not torch.equal(a, c) for (a, _), (c, _) in pairs)
    with pytest.raises(ValueError, match=f"kv '{kv}' needs attention 'triton'"):
        BatchedDecoder(model, 3, 256, greedy, "sdpa", kv=kv)


def test_the_serving_step_with_the_kernel_gives_sdpas_tokens() -> None:
    """BatchedDecoder with attention='triton' against its SDPA path: three rows of other
    prompt lengths (one past twice the sliding window), greedy, float32, four steps: the same
    tokens at every step, and the same caches after them (each layer's keys and values
    follow the attention below it, so a window or length fault shows there even where the
    greedy tokens survive it)."""
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_decode import BatchedDecoder

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    long = " ".join(["A longer sentence, to reach well past the sliding window."] * 3)
    prompts = [model.encode_prompt(build_prompt(t, "Ira", "neutral")) for t in ["Hi.", long, "Ok."]]
    assert max(map(len, prompts)) > 2 * model.config.sliding_window
    greedy = SamplingConfig(top_k=1)
    steps, caches = [], []
    for attention in ("sdpa", "triton"):
        dec = BatchedDecoder(model, 3, 256, greedy, attention, attention_splits=SPLITS)
        with torch.inference_mode():
            dec.prefill([0, 1, 2], prompts, [1, 2, 3], [False] * 3)
            steps.append([dec.step(3, 256).tolist() for _ in range(4)])
        caches.append(torch.cat([dec.k, dec.v]))
    assert steps[0] == steps[1]
    assert rel_err(caches[1], caches[0]) < 1e-5


def test_the_serving_step_with_kernel_glue_gives_the_torch_glues_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BatchedDecoder with glue='triton' (LayerNorm, rotary + cache write, SwiGLU kernels;
    its prompt writes' norms and SwiGLU too) against glue='torch', both over the attention
    kernel: three rows of other prompt lengths,
    greedy, float32, four steps: the same tokens, the same caches, teacher-forced logits
    within rounding; and the kernels did run (each once per layer and step)."""
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_decode import BatchedDecoder

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    long = " ".join(["A longer sentence, to reach well past the sliding window."] * 3)
    prompts = [model.encode_prompt(build_prompt(t, "Ira", "neutral")) for t in ["Hi.", long, "Ok."]]
    calls = {"rope": 0, "swiglu": 0}

    def counted(name: str, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    rope_rows = counted("rope", rn.rope_and_cache_write_rows)
    monkeypatch.setattr(rn, "rope_and_cache_write_rows", rope_rows)
    monkeypatch.setattr(sw, "swiglu_rows", counted("swiglu", sw.swiglu_rows))
    greedy = SamplingConfig(top_k=1)
    ids = [model.vocab.codebook_ids(i % 8) for i in range(3)]
    forced = [[int(ids[i][5 * r + i]) for i in range(3)] for r in range(3)]
    steps, caches, logits = [], [], []
    for glue in ("torch", "triton"):
        dec, forcing = (
            BatchedDecoder(model, 3, 256, greedy, "triton", glue=glue, attention_splits=SPLITS)
            for _ in range(2)
        )
        with torch.inference_mode():
            dec.prefill([0, 1, 2], prompts, [1, 2, 3], [False] * 3)
            steps.append([dec.step(3, 256).tolist() for _ in range(4)])
            caches.append(torch.cat([dec.k, dec.v]))
            logits.append(forcing.teacher_forced(prompts, forced))
    layers = model.config.num_hidden_layers
    # glue triton: 4 steps and 3 forced rotate; their SwiGLU also runs in the 2 prompt writes
    assert calls == {"rope": layers * 7, "swiglu": layers * 9}
    assert steps[0] == steps[1]
    assert rel_err(caches[1], caches[0]) < 1e-5
    for (a, ia), (c, ic) in zip(*logits, strict=True):
        assert torch.equal(ia, ic) and rel_err(c, a) < 1e-5
    with pytest.raises(ValueError, match="glue 'triton' needs attention 'triton'"):
        BatchedDecoder(model, 3, 256, greedy, "sdpa", glue="triton")
    with pytest.raises(ValueError, match="glue 'fused': one of torch, triton"):
        BatchedDecoder(model, 3, 256, greedy, "triton", glue="fused")


def test_few_rows_split_their_attention_and_step_as_unsplit_within_rounding() -> None:
    """BatchedDecoder's attention_splits 'auto' (the default): at 3 rows x 2 kv heads each
    row's positions are split 16 ways (32-position blocks) and merged; against 1 (never
    split), float32, greedy, kernel glue and torch glue: the hidden states within rounding
    and two steps' tokens equal. At 32 rows (64 programs) nothing is split."""
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_decode import ATTENTION_BLOCK_FP32, BatchedDecoder

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    long = " ".join(["A longer sentence, to reach well past one block."] * 3)
    prompts = [model.encode_prompt(build_prompt(t, "Ira", "neutral")) for t in ["Hi.", long, "Ok."]]
    greedy = SamplingConfig(top_k=1)
    for glue in ("torch", "triton"):
        runs = []
        for splits in ("auto", 1):
            dec = BatchedDecoder(model, 3, 256, greedy, "triton", glue=glue,
                                 attention_splits=splits)  # fmt: skip
            with torch.inference_mode():
                dec.prefill([0, 1, 2], prompts, [1, 2, 3], [False] * 3)
                hidden = dec._forward(3, 256).clone()  # glue triton: _forward_fused
                runs.append((hidden, [dec.step(3, 256).tolist() for _ in range(2)]))
        assert dec.splits(3) == {"block_s": ATTENTION_BLOCK_FP32}  # splits 1: never
        dec.attention_splits = "auto"
        assert dec.splits(3) == {"num_splits": 16, "block_s": 32}
        assert dec.splits(32) == {"block_s": ATTENTION_BLOCK_FP32}  # float32: 64
        (h_split, t_split), (h_one, t_one) = runs
        assert t_split == t_one, glue
        assert 0 < rel_err(h_split, h_one) < 1e-5, glue  # another order of the same sums


def test_the_attention_block_sums_in_other_blocks_and_steps_the_same() -> None:
    """attention_block 128 against 64 (the unsplit launch's positions a block; an fp8 cache,
    float32 arithmetic, greedy, kernel glue), one row whose prompt spans two 64-position
    blocks and one of 128: the hidden state within rounding but not equal (the option
    reaches the kernel) and two steps' tokens equal. The default is 128 over a 1- or 2-byte
    cache and 64 over a float32 one, where 128 is refused (its blocks do not fit an H100's
    shared memory); another block with SDPA, or one the decoder does not know, is refused.
    (One row, two steps: the interpreter's time in CI is this file's bound.)"""
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_decode import BatchedDecoder

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    text = "A longer sentence, to reach well past one block."
    prompts = [model.encode_prompt(build_prompt(text, "Ira", "neutral"))]
    assert 64 < len(prompts[0]) < 126
    greedy = SamplingConfig(top_k=1)
    runs = []
    for block in (64, 128):
        dec = BatchedDecoder(model, 1, 256, greedy, "triton", glue="triton", kv="fp8",
                             attention_block=block, attention_splits=1)  # fmt: skip
        assert dec.splits(1) == {"block_s": block}
        with torch.inference_mode():
            dec.prefill([0], prompts, [1], [False])
            hidden = dec._forward(1, 256).clone()
            runs.append((hidden, [dec.step(1, 256).tolist() for _ in range(2)]))
    (h64, t64), (h128, t128) = runs
    assert t64 == t128
    assert 0 < rel_err(h128, h64) < 1e-5
    fp8 = BatchedDecoder(model, 1, 96, greedy, "triton", kv="fp8", attention_splits=1)
    fp32 = BatchedDecoder(model, 1, 96, greedy, "triton", attention_splits=1)
    assert (fp8.splits(1), fp32.splits(1)) == ({"block_s": 128}, {"block_s": 64})
    with pytest.raises(ValueError, match="attention_block 128 over a torch.float32 cache"):
        BatchedDecoder(model, 1, 96, greedy, "triton", attention_block=128)
    with pytest.raises(ValueError, match="needs attention 'triton'"):
        BatchedDecoder(model, 1, 96, greedy, "sdpa", attention_block=64)
    with pytest.raises(ValueError, match="attention_block 96: one of"):
        BatchedDecoder(model, 1, 96, greedy, "triton", attention_block=96)
    with pytest.raises(ValueError, match="attention_splits 4: 'auto' or 1"):
        BatchedDecoder(model, 1, 96, greedy, "triton", attention_splits=4)


def test_chunked_prefill_writes_the_cache_a_prompt_write_writes() -> None:
    """chunk_tokens (glue 'triton', float32): two prompts go into rows 1 and 2 as 16-token
    chunks riding along steps of row 0, which decodes meanwhile (rows 1 and 2 held inside
    the step's rows), the longer prompt across steps. Their caches match write_prompts'
    within rounding (the same maths; the chunk's attention is the kernel's, not SDPA);
    row 0 draws the tokens plain steps draw; once armed, rows 1 and 2 draw the tokens they
    draw after write_prompts."""
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_decode import BatchedDecoder

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    texts = ["Hi.", "A longer sentence, to span a few chunks of prompt.", "Ok, go."]
    prompts = [model.encode_prompt(build_prompt(t, "Ira", "neutral")) for t in texts]
    greedy, cap = SamplingConfig(top_k=1), 128
    seeds, ends = [1, 2, 3], [False] * 3

    def decoder(chunk: int = 0) -> BatchedDecoder:
        return BatchedDecoder(model, 3, cap, greedy, "triton", glue="triton", chunk_tokens=chunk,
                              attention_splits=SPLITS)  # fmt: skip

    with torch.inference_mode():
        whole = decoder()  # every prompt by write_prompts, then 4 steps
        whole.prefill([0, 1, 2], prompts, seeds, ends)
        whole_cache = [t.clone() for t in (whole.k, whole.v)]
        whole_tokens = [whole.step(3, cap).tolist() for _ in range(4)]
        plain = decoder()  # row 0 alone, plain steps
        plain.prefill([0], prompts[:1], seeds[:1], ends[:1])
        chunked = decoder(16)
        chunked.prefill([0], prompts[:1], seeds[:1], ends[:1])
        chunked.hold([1, 2])
        queue = [(r, p, t) for r in (1, 2) for p, t in enumerate(prompts[r][:-1])]
        row0 = []
        for i in range(0, len(queue), 16):
            part = queue[i : i + 16]
            chunked.stage_chunk(*(list(x) for x in zip(*part, strict=True)), c=16)
            row0.append((chunked.step(3, cap, 16)[0].item(), plain.step(3, cap)[0].item()))
        assert len(row0) >= 3  # the longer prompt crossed a step
        chunked.arm([1, 2], prompts[1:], seeds[1:], ends[1:])
        for r in (1, 2):
            t = len(prompts[r]) - 1
            for got, want in zip((chunked.k, chunked.v), whole_cache, strict=True):
                assert rel_err(got[:, r, :, :t], want[:, r, :, :t]) < 1e-5, r
        tokens = [chunked.step(3, cap).tolist() for _ in range(4)]
    assert all(a == b for a, b in row0)
    assert [t[1:] for t in tokens] == [t[1:] for t in whole_tokens]
    with pytest.raises(ValueError, match="positive with glue 'triton'"):
        BatchedDecoder(model, 3, cap, greedy, "triton", chunk_tokens=16)
    with pytest.raises(ValueError, match="1 to 16 tokens"):
        chunked.stage_chunk([1] * 17, list(range(17)), [5] * 17, c=16)


def test_a_server_prefilling_by_chunks_serves_the_tokens_prompt_writes_serve() -> None:
    """BatchedServer with chunk_tokens 16 (kernel glue, float32, greedy, two rows, three
    requests: a row refilled, prompts split across steps while another row decodes), also
    pipelined, against the same server writing prompts apart: every request's tokens
    equal; steps carried the prompts (counted), and nothing was left pending or held."""
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_server import BatchedServer, ServeRequest

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    texts = ["Hi.", "A longer sentence, to span a few chunks of prompt.", "Ok, go."]
    reqs = [
        ServeRequest(k, model.encode_prompt(build_prompt(t, "Ira", "neutral")), 1, seed=k)
        for k, t in enumerate(texts)
    ]
    runs = []
    for chunk, pipeline in ((0, False), (16, False), (16, True)):
        server = BatchedServer(model, 2, 128, SamplingConfig(top_k=1), graphs=False,
                               codec=False, attention="triton", glue="triton",
                               chunk_tokens=chunk, pipeline=pipeline,
                               attention_splits=SPLITS)  # fmt: skip
        waiting = list(reqs)
        with torch.inference_mode():
            while waiting or server.live():
                waiting = waiting[server.admit(waiting) :]
                server.step()
        runs.append(server)
    writes, chunks, pipelined = runs
    assert sorted(chunks.tokens) == [0, 1, 2] and chunks.tokens == writes.tokens
    assert pipelined.tokens == writes.tokens and pipelined.inflight is None
    prompt_tokens = sum(len(r.prompt_ids) - 1 for r in reqs)
    assert chunks.stats.chunk_tokens == prompt_tokens and chunks.stats.prefill_writes["chunk"] > 3
    assert "chunk" not in writes.stats.prefill_writes
    assert not chunks.pending and not chunks.row_prefilling.any()


def test_chunks_take_prompts_oldest_first_and_split_them_at_the_budget() -> None:
    """The server's chunk staging, no step run: prompts of 1, 40 and 7 tokens (writing 0, 39
    and 6) into rows 0, 1, 2 with chunk_tokens 32: the first chunk completes the one-token
    prompt (nothing to write) and carries 32 of the second's tokens, padded to no bucket
    (32 is one); the next carries its last 7 and the third's 6, padded to 32 with tokens
    that write the scratch row; held rows sit at position -1; a full queue refuses more."""
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.techniques.rumik.batched_server import (
        BatchedServer,
        Prefilling,
        ServeRequest,
    )

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    server = BatchedServer(model, 4, 128, SamplingConfig(top_k=1), graphs=False, codec=False,
                           attention="triton", glue="triton", chunk_tokens=32,
                           max_prefill_tokens=50)  # fmt: skip
    prompts = [[7], list(range(100, 140)), list(range(200, 207))]
    reqs = [ServeRequest(k, p, 1, seed=k) for k, p in enumerate(prompts)]
    assert server.admit(reqs) == 3 and server.row_prefilling[:3].all()
    assert server.dec.pos[:3].tolist() == [-1, -1, -1]
    dec = server.dec
    c, done = server._stage_chunk()
    assert (c, [p.row for p in done]) == (32, [0])
    assert dec.chunk_rows[:32].tolist() == [1] * 32
    assert dec.chunk_pos[:32].tolist() == list(range(32))
    assert dec.chunk_ids[:32].tolist() == prompts[1][:32]
    c, done = server._stage_chunk()
    assert (c, [p.row for p in done]) == (32, [1, 2])
    assert dec.chunk_rows[:32].tolist() == [1] * 7 + [2] * 6 + [dec.scratch] * 19
    assert dec.chunk_pos[:13].tolist() == list(range(32, 39)) + list(range(6))
    assert dec.chunk_ids[:13].tolist() == prompts[1][32:39] + prompts[2][:6]
    assert not server.pending and server.stats.chunk_tokens == 45
    assert server.stats.chunk_padding == 19
    # 45 tokens queued (a row's prompt not yet written): a request of 7 more would pass 50
    server.pending.append(Prefilling(3, ServeRequest(8, list(range(46)), 1, seed=8)))
    assert server.admit([ServeRequest(9, list(range(8)), 1, seed=9)]) == 0


def assert_fp8_agree(got: torch.Tensor, want: torch.Tensor, steps: int = 0) -> None:
    """e4m3 values written by a kernel against torch's: the same bytes but for a rounding
    step in under 1% of them on a GPU (the fp32 sums before the cast run in another order),
    and none more than `steps` + 1 codes apart (the sign bit equal: e4m3 codes of one sign
    are ordered by magnitude). Triton's CPU interpreter also drops the carry of a rounding
    into the exponent (31.9 becomes 16, not 32): there a value may be half torch's."""
    a, b = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    near = ((a >> 7) == (b >> 7)) & ((a - b).abs() <= steps + 1)
    if CUDA:
        assert near.all() and (a == b).float().mean() > 0.99
        return
    doubled = (got.float() * 2).to(got.dtype).view(torch.uint8).int()
    carry = ((doubled >> 7) == (b >> 7)) & ((doubled - b).abs() <= steps + 1)
    assert (near | carry).all() and ((a - b).abs() <= steps)[~carry].float().mean() > 0.99


def test_kernel_glue_writes_the_fp8_cache_the_torch_glue_writes() -> None:
    """kv='fp8' with glue='triton' (the rotary kernel quantizes as it writes) against
    glue='torch' (quantize_rows after the eager write): three rows, greedy, float32, four
    steps: the same tokens; in the first layer (whose inputs do not depend on the cache) the
    same scales within rounding and the same e4m3 bytes but for a rounding step in a few
    values; deeper, those flips move attention a little (scales within 1e-2)."""
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_decode import BatchedDecoder

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    prompts = [model.encode_prompt(build_prompt(t, "Ira", "neutral")) for t in ["Hi.", "Ok, go."]]
    greedy = SamplingConfig(top_k=1)
    runs = []
    for glue in ("torch", "triton"):
        dec = BatchedDecoder(model, 2, 96, greedy, "triton", kv="fp8", glue=glue,
                             attention_splits=SPLITS)  # fmt: skip
        with torch.inference_mode():
            dec.prefill([0, 1], prompts, [1, 2], [False] * 2)
            tokens = [dec.step(2, 96).tolist() for _ in range(4)]
        runs.append((tokens, dec))
    (t0, a), (t1, b) = runs
    assert t0 == t1
    written = a.k_scale > 0  # every position a step or a prompt wrote
    assert written.sum() > 0 and torch.equal(written, b.k_scale > 0)
    assert rel_err(b.k_scale[0], a.k_scale[0]) < 1e-6
    assert rel_err(b.v_scale[0], a.v_scale[0]) < 1e-6
    for x, y in ((a.k[0], b.k[0]), (a.v[0], b.v[0])):
        assert_fp8_agree(y[written[0]], x[written[0]])
    assert rel_err(b.k_scale, a.k_scale) < 1e-2 and rel_err(b.v_scale, a.v_scale) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_swiglu_kernels_quantize_what_they_would_write(dtype: torch.dtype) -> None:
    """layer_norm_fp8 and swiglu_rows_fp8 against quantize_rows of the unquantized kernels'
    output (the norm, the activation, as the model's dtype stores them): the same scales
    (within the interpreter's bf16 truncation) and e4m3 bytes (assert_fp8_agree)."""
    from orchestrate.techniques.rumik.fp8_projections import quantize_rows

    x, w = randn(3, 2048, dtype=dtype), (torch.rand(2048, device=DEVICE) + 0.5).to(dtype)
    out = randn(3, 2 * 3000, dtype=dtype)
    gate, up = out[:, :3000], out[:, 3000:]
    cases = (
        (rn.layer_norm_fp8(x, w), quantize_rows(rn.layer_norm(x, w))),
        (sw.swiglu_rows_fp8(gate, up), quantize_rows(sw.swiglu_rows(gate, up))),
    )
    for (q, scale), (q_ref, scale_ref) in cases:
        assert q.dtype == torch.float8_e4m3fn and scale.shape == scale_ref.shape == (3, 1)
        exact = dtype == torch.float32 or CUDA
        assert rel_err(scale, scale_ref) < (1e-6 if exact else 1e-2)
        assert_fp8_agree(q, q_ref, steps=0 if exact else 1)
    with pytest.raises(ValueError, match=r"x must be \[M, N\]"):
        rn.layer_norm_fp8(x[None], w)
    with pytest.raises(ValueError, match="rows of at most 16384"):
        sw.swiglu_rows_fp8(randn(1, 16400, dtype=dtype), randn(1, 16400, dtype=dtype))


def test_kernel_glue_quantizes_fp8_projections_inputs_in_its_norm_and_swiglu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """glue='triton' with FP8 projections (emulated on the CPU): the norm's and the SwiGLU's
    kernels quantize their rows (each called once a layer and step), and the teacher-forced
    logits match glue='torch' with the same projections (quantize_rows after eager ops):
    the same quantization, fused. On a GPU within rounding (cosine 0.999); in the CPU
    interpreter, whose dropped rounding carries halve a few e4m3 values (the kernel tests
    above bound them), within 0.95."""
    import torch.nn.functional as F

    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik.vocab import build_prompt
    from orchestrate.techniques.rumik.batched_decode import BatchedDecoder
    from orchestrate.techniques.rumik.fp8_projections import Fp8Packed

    model = get_family("rumik").build_model(
        ModelSpec(preset="small-128", device=DEVICE.type, dtype="float32")
    )
    prompts = [model.encode_prompt(build_prompt(t, "Ira", "neutral")) for t in ["Hi.", "Ok, go."]]
    ids = [model.vocab.codebook_ids(i % 8) for i in range(3)]
    forced = [[int(ids[i][5 * r + i]) for i in range(3)] for r in range(2)]
    calls = {"norm": 0, "swiglu": 0}
    for name, module, fn in (("norm", rn, "layer_norm_fp8"), ("swiglu", sw, "swiglu_rows_fp8")):
        real = getattr(module, fn)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, fn, counted)
    proj = Fp8Packed(model, emulate=True)
    greedy = SamplingConfig(top_k=1)
    logits = {}
    for glue in ("torch", "triton"):
        dec = BatchedDecoder(model, 2, 96, greedy, "triton", projections=proj, glue=glue,
                             attention_splits=SPLITS)  # fmt: skip
        with torch.inference_mode():
            logits[glue] = dec.teacher_forced(prompts, forced)
    layers = model.config.num_hidden_layers
    assert calls == {"norm": 3 * layers, "swiglu": 3 * layers}
    for (a, ia), (c, ic) in zip(logits["torch"], logits["triton"], strict=True):
        assert torch.equal(ia, ic)
        assert (F.cosine_similarity(a, c, dim=-1) > (0.999 if CUDA else 0.95)).all()


@pytest.mark.parametrize(
    "m, n, k, split",
    [(5, 48, 96, 1), (20, 40, 256, 2), (3, 64, 160, 3)],
    ids=["one-pass", "split-2-row-and-column-edges", "split-3-uneven-slices"],
)
def test_fp8_gemm_is_the_scaled_product_of_its_e4m3_operands(m, n, k, split) -> None:
    """kernels/fp8_gemm.py against the product of the dequantized operands (what
    _scaled_mm computes) in float32: within bf16 rounding of each output (the interpreter
    truncates: one bf16 step; the GPU rounds: half of one). Rows and columns past a
    block's edge, and K slices that do not divide evenly, included."""
    from orchestrate.techniques.rumik.fp8_projections import Fp8Weight, quantize_rows

    xq, xs = quantize_rows(randn(m, k) * torch.linspace(0.1, 10, m, device=DEVICE)[:, None])
    w = Fp8Weight.of(randn(n, k) * 0.05)
    want = (xq.float() * xs) @ (w.q.float() * w.scale.t()).t()
    got = f8g.fp8_gemm(xq, xs, w.q, w.scale, f8g.GemmConfig(16, 32, 32, split, 4, 2))
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = (got.float() - want).abs()
    assert (err <= 2**-7 * want.abs() + 1e-4 * want.abs().max()).all()
    # the scales matter: the same operands with the weights' scales left out are far off
    unscaled = f8g.fp8_gemm(xq, xs, w.q, torch.ones_like(w.scale), f8g.GemmConfig(16, 32, 32))
    assert not torch.allclose(unscaled.float(), want, rtol=0.1)


def test_fp8_gemm_refuses_what_it_does_not_compute() -> None:
    from orchestrate.techniques.rumik.fp8_projections import quantize_rows

    xq, xs = quantize_rows(randn(4, 64))
    wq, ws = quantize_rows(randn(32, 64))
    ws = ws.t().contiguous()
    with pytest.raises(ValueError, match="e4m3 operands"):
        f8g.fp8_gemm(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match=r"\[M, K\] x \[N, K\]"):
        f8g.fp8_gemm(xq, xs, wq[:, :32].contiguous(), ws)
    with pytest.raises(ValueError, match="contiguous scales"):
        f8g.fp8_gemm(xq, xs, wq, torch.cat([ws, ws]).t().reshape(1, -1)[:, ::2])  # strided
    with pytest.raises(ValueError, match="K a multiple of 16"):
        f8g.fp8_gemm(xq[:, :40].contiguous(), xs, wq[:, :40].contiguous(), ws)
    empty = f8g.fp8_gemm(xq[:0], xs[:0], wq, ws)  # no rows: no launch, an empty product
    assert empty.shape == (0, 32) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("width", [2048, 11008])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_fp8_is_quantize_rows_in_one_kernel(width: int, dtype: torch.dtype) -> None:
    """The kernel against fp8_projections.quantize_rows on strided rows (column slices of a
    wider output) of different magnitudes: the same scales, the same e4m3 bytes (on the
    CPU, but for the interpreter's dropped carries: assert_fp8_agree)."""
    from orchestrate.techniques.rumik.fp8_projections import quantize_rows

    wide = randn(3, width + 40, dtype=dtype) * torch.tensor([[0.01], [1.0], [300.0]], device=DEVICE)
    x = wide[:, 8 : 8 + width]
    q, scale = fq.quantize_rows_fp8(x)
    q_ref, scale_ref = quantize_rows(x)
    assert q.shape == x.shape and scale.shape == (3, 1)
    assert torch.equal(scale, scale_ref)
    if CUDA:
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert_fp8_agree(q, q_ref)
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        fq.quantize_rows_fp8(x[None])
    with pytest.raises(ValueError, match="rows of 1..16384 values"):
        fq.quantize_rows_fp8(randn(1, 16385, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write_rows_quantizes_into_an_fp8_cache(dtype: torch.dtype) -> None:
    """With e4m3 caches and scales, each key and value vector stored as quantize_rows stores
    it (its amax to 448, float32 scale beside it), at each row's own position."""
    cos, sin = rn.rope_cos_sin(512, dtype=dtype, device=DEVICE)
    q, k, v = (
        randn(2, 16, 128, dtype=dtype),
        randn(2, 4, 128, dtype=dtype) * 3,
        randn(2, 4, 128, dtype=dtype),
    )
    fp8 = torch.float8_e4m3fn
    kc = torch.zeros(2, 4, 64, 128, dtype=fp8, device=DEVICE)
    vc = torch.zeros_like(kc)
    ks, vs = torch.zeros(2, 4, 64, device=DEVICE), torch.zeros(2, 4, 64, device=DEVICE)
    ref = [t.clone() for t in (kc, vc, ks, vs)]
    positions = [5, 40]
    pos = torch.tensor(positions, device=DEVICE)
    q_out = rn.rope_and_cache_write_rows(q, k, v, kc, vc, pos, cos, sin, k_scale=ks, v_scale=vs)
    q_ref = rn.rope_and_cache_write_rows_ref(q, k, v, *ref[:2], positions, cos, sin,
                                             k_scale=ref[2], v_scale=ref[3])  # fmt: skip
    assert rel_err(q_out, q_ref) < tol(dtype)
    assert (ks[0, :, 5] > 0).all() and (ks[1, :, 40] > 0).all() and (ks > 0).sum() == 8
    written = ks > 0
    for got, want, scale, scale_ref in ((kc, ref[0], ks, ref[2]), (vc, ref[1], vs, ref[3])):
        if dtype == torch.float32:  # the vector quantized is the rotation's fp32 result
            assert rel_err(scale, scale_ref) < 1e-6
            assert_fp8_agree(got[written], want[written])
        else:  # rounded to bf16 first (by truncation in the interpreter: within an ulp)
            assert rel_err(scale, scale_ref) < 1e-2
            assert_fp8_agree(got[written], want[written], steps=1)
        assert torch.equal(got[~written].float(), want[~written].float())  # nothing else
        assert got.float().abs().amax() == 448.0  # each vector's largest value maps to 448
    with pytest.raises(ValueError, match="caches need k_scale and v_scale"):
        rn.rope_and_cache_write_rows(q, k, v, kc, vc, pos, cos, sin)
    with pytest.raises(ValueError, match="scales go with float8_e4m3fn or uint8"):
        rn.rope_and_cache_write_rows(q, k, v, kc.to(dtype), vc.to(dtype), pos, cos, sin,
                                     k_scale=ks, v_scale=vs)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write_rows_packs_into_an_int4_cache(dtype: torch.dtype) -> None:
    """With uint8 caches and scales, each key and value vector stored as quantize_int4
    stores it (two values a byte, its amax to 7, float32 scale beside it) at each row's own
    position, and the batched attention reads back what it wrote."""
    from orchestrate.techniques.rumik.kernels.int4_cache import unpack_int4

    cos, sin = rn.rope_cos_sin(512, dtype=dtype, device=DEVICE)
    q, k, v = (
        randn(2, 16, 128, dtype=dtype),
        randn(2, 4, 128, dtype=dtype) * 3,
        randn(2, 4, 128, dtype=dtype),
    )
    kc = torch.zeros(2, 4, 64, 64, dtype=torch.uint8, device=DEVICE)
    vc = torch.zeros_like(kc)
    ks, vs = torch.zeros(2, 4, 64, device=DEVICE), torch.zeros(2, 4, 64, device=DEVICE)
    ref = [t.clone() for t in (kc, vc, ks, vs)]
    positions = [5, 40]
    pos = torch.tensor(positions, device=DEVICE)
    q_out = rn.rope_and_cache_write_rows(q, k, v, kc, vc, pos, cos, sin, k_scale=ks, v_scale=vs)
    q_ref = rn.rope_and_cache_write_rows_ref(q, k, v, *ref[:2], positions, cos, sin,
                                             k_scale=ref[2], v_scale=ref[3])  # fmt: skip
    assert rel_err(q_out, q_ref) < tol(dtype)
    written = ks > 0
    assert written.sum() == 8 and written[0, :, 5].all() and written[1, :, 40].all()
    for got, want, scale, scale_ref in ((kc, ref[0], ks, ref[2]), (vc, ref[1], vs, ref[3])):
        n, n_ref = unpack_int4(got[written]), unpack_int4(want[written])
        if dtype == torch.float32:  # the same fp32 quotients, rounded the same way
            assert rel_err(scale, scale_ref) < 1e-6
            assert torch.equal(n, n_ref)
        else:  # rounded to bf16 first (by truncation in the interpreter: within an ulp)
            assert rel_err(scale, scale_ref) < 1e-2
            assert float((n - n_ref).abs().max()) <= 1.0
            assert float((n != n_ref).float().mean()) < 0.05
        assert torch.equal(got[~written], want[~written])  # nothing else
        assert float(n.abs().amax(-1).min()) == 7.0  # each vector's largest value maps to 7
    lengths = [6, 41]  # through each row's new position
    out = battn.batched_decode_attention(q_out, kc, vc, torch.tensor(lengths, device=DEVICE),
                                         k_scale=ks, v_scale=vs, block_s=32)  # fmt: skip
    want = battn.batched_decode_attention_ref(q_out, kc, vc, lengths, k_scale=ks, v_scale=vs)
    assert rel_err(out, want) < tol(dtype)
    with pytest.raises(ValueError, match="packed INT4 caches hold 64 bytes a position"):
        rn.rope_and_cache_write_rows(q, k, v, kc[..., :32], vc[..., :32], pos, cos, sin,
                                     k_scale=ks, v_scale=vs)  # fmt: skip


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write_rows_each_row_at_its_own_position(
    rotary: bool, dtype: torch.dtype
) -> None:
    """Three rows (strided views of a batched packed projection's output) at positions 37, 0
    and 63: each row's q and k rotated at its own position, its k and v written into its
    own cache row at that position and nowhere else."""
    cos, sin = rn.rope_cos_sin(512, dtype=dtype, device=DEVICE)
    out = randn(3, 16 * 128 + 2 * 4 * 128 + 64, dtype=dtype)
    q, k, v = (out[:, :2048].view(3, 16, 128), out[:, 2048:2560].view(3, 4, 128),
               out[:, 2560:3072].view(3, 4, 128))  # fmt: skip
    kc, vc = randn(3, 4, 64, 128, dtype=dtype), randn(3, 4, 64, 128, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    positions = [37, 0, 63]
    pos = torch.tensor(positions, device=DEVICE)
    q_out = rn.rope_and_cache_write_rows(q, k, v, kc, vc, pos, cos, sin, rotary=rotary)
    q_ref = rn.rope_and_cache_write_rows_ref(q, k, v, kc_ref, vc_ref, positions, cos, sin,
                                             rotary=rotary)  # fmt: skip
    assert rel_err(q_out, q_ref) < tol(dtype)
    assert rel_err(kc, kc_ref) < tol(dtype) and torch.equal(vc, vc_ref)
    for r, p in enumerate(positions):
        others = torch.ones(64, dtype=torch.bool)
        others[p] = False
        assert torch.equal(kc[r][:, others], kc_ref[r][:, others])
    if rotary:  # rows really were rotated at different positions
        assert not torch.equal(q_out[0], q[0])
    with pytest.raises(ValueError, match=r"pos must be \[3\] int32 or int64"):
        rn.rope_and_cache_write_rows(q, k, v, kc, vc, pos[:2], cos, sin)
    with pytest.raises(ValueError, match="need 3 rows"):
        rn.rope_and_cache_write_rows(q, k[:2], v[:2], kc, vc, pos, cos, sin)


@pytest.mark.parametrize("fp8", [False, True])
def test_rope_and_cache_write_rows_writes_the_cache_row_its_map_gives(fp8: bool) -> None:
    """With `cache_rows`, row r writes cache row cache_rows[r] at pos[r]: two rows of one
    prompt into cache row 2 at positions 5 and 6, one into row 0 at 3, and one at position
    -1 that writes nothing (a row whose stream is being prefilled); q of every row rotated
    at its own position. Against the reference row by row, nothing else written."""
    cos, sin = rn.rope_cos_sin(512, device=DEVICE)
    q, k, v = randn(4, 16, 128), randn(4, 4, 128), randn(4, 4, 128)
    dt = torch.float8_e4m3fn if fp8 else torch.float32
    kc, vc = (torch.zeros(4, 4, 16, 128, device=DEVICE).to(dt) for _ in range(2))
    scales = {}
    if fp8:
        scales = {"k_scale": torch.zeros(4, 4, 16, device=DEVICE),
                  "v_scale": torch.zeros(4, 4, 16, device=DEVICE)}  # fmt: skip
    rows, positions = [2, 2, 0, 3], [5, 6, 3, -1]
    q_out = rn.rope_and_cache_write_rows(
        q, k, v, kc, vc, torch.tensor(positions, device=DEVICE), cos, sin,
        cache_rows=torch.tensor(rows, device=DEVICE), **scales,
    )  # fmt: skip
    written = torch.zeros(4, 16, dtype=torch.bool)
    for r, (row, p) in enumerate(zip(rows[:3], positions[:3], strict=True)):
        one_k, one_v = (torch.zeros(1, 4, 16, 128, device=DEVICE).to(dt) for _ in range(2))
        one_s = {n: torch.zeros(1, 4, 16, device=DEVICE) for n in scales}
        want_q = rn.rope_and_cache_write_rows_ref(
            q[r : r + 1], k[r : r + 1], v[r : r + 1], one_k, one_v, [p], cos, sin, **one_s
        )
        assert rel_err(q_out[r], want_q[0]) < tol(torch.float32)
        for got, want in ((kc[row, :, p], one_k[0, :, p]), (vc[row, :, p], one_v[0, :, p])):
            if fp8:  # the kernel's e4m3 rounding against torch's: within a step
                assert_fp8_agree(got, want)
            else:  # the rotation's fp32 sums in another order on a GPU
                assert rel_err(got, want) < tol(torch.float32)
        for name in scales:
            assert rel_err(scales[name][row, :, p], one_s[name][0, :, p]) < 1e-6
        written[row, p] = True
    assert rel_err(q_out[3], q[3]) == 0.0  # outside the table: not rotated
    untouched = ~written[:, None, :].expand(4, 4, 16)  # [rows, heads, positions]
    assert kc[untouched].float().abs().max() == 0.0 and vc[untouched].float().abs().max() == 0.0
    with pytest.raises(ValueError, match=r"cache_rows must be \[4\] int32 or int64"):
        rn.rope_and_cache_write_rows(q, k, v, kc, vc, torch.tensor(positions, device=DEVICE),
                                     cos, sin, cache_rows=torch.zeros(3, dtype=torch.long,
                                     device=DEVICE), **scales)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_rows_matches_eager(dtype: torch.dtype) -> None:
    out = randn(3, 2 * 1500 + 7, dtype=dtype)  # gate and up: strided column slices
    gate, up = out[:, :1500], out[:, 1500:3000]
    got = sw.swiglu_rows(gate, up)
    want = torch.nn.functional.silu(gate) * up
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else tol(dtype))
    with pytest.raises(ValueError, match="gate .* and up .* differ"):
        sw.swiglu_rows(gate, up[:, :10])
    with pytest.raises(ValueError, match=r"must be \[B, F\]"):
        sw.swiglu_rows(gate[0], up[0])


def test_batched_decode_attention_rejects_unsupported() -> None:
    q, k = randn(2, 16, 128), randn(2, 4, 32, 128)
    lengths = torch.tensor([4, 4], device=DEVICE)
    with pytest.raises(ValueError, match=r"must be \[B, Hq, D\]"):
        battn.batched_decode_attention(q[0], k, k, lengths)
    with pytest.raises(ValueError, match="2 query rows but caches of 3"):
        battn.batched_decode_attention(q, randn(3, 4, 32, 128), randn(3, 4, 32, 128), lengths)
    with pytest.raises(ValueError, match="lengths must be"):
        battn.batched_decode_attention(q, k, k, lengths.float())
    with pytest.raises(ValueError, match="head_dim must be 128"):
        battn.batched_decode_attention(randn(2, 16, 64), randn(2, 4, 32, 64),
                                       randn(2, 4, 32, 64), lengths)  # fmt: skip


# --------------------------------------------------------------------------- sampler


def _chi2_critical(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z=4.75: p ~ 1e-6)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _assert_distribution(draws: torch.Tensor, probs: torch.Tensor) -> None:
    n = draws.numel()
    counts = torch.bincount(draws.cpu(), minlength=probs.numel()).double()
    p = probs.cpu().double()
    assert bool((counts[p == 0] == 0).all()), "sampled a column outside the top-k support"
    tv = 0.5 * float((counts / n - p).abs().sum())
    assert tv < 0.08, f"total variation {tv:.3f}"
    big = p * n >= 5  # chi-square over well-populated columns, the rest pooled
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([p[big] * n, (p[~big] * n).sum()[None]])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert chi2 < _chi2_critical(int(keep.sum()) - 1), f"chi2 {chi2:.1f}"


SAMPLER_CASES = [
    (1000, 4096, {}),  # one program (codebook-head width path)
    (3000, 512, {"allowed": (100, 2000), "extra_allowed": 2999}),  # two stages + allowed range
]


@pytest.mark.parametrize("width,block,kw", SAMPLER_CASES)
def test_sampler_distribution(width: int, block: int, kw: dict) -> None:
    logits = randn(width, scale=2.0)
    counter = dev_int(7, torch.int64)
    draws = samp.sample_top_k(logits, counter, seed=1234, num_samples=4096, block_v=block,
                              single_max=1024, **kw)  # fmt: skip
    assert draws.dtype == torch.int64 and draws.device.type == DEVICE.type
    assert int(counter) == 7 + 4096
    _assert_distribution(draws, samp.top_k_probs_ref(logits, **kw))


def test_sampler_additive_mask_and_bf16() -> None:
    logits = randn(900, dtype=torch.bfloat16, scale=2.0)
    mask = torch.full((900,), float("-inf"), device=DEVICE)
    mask[::8] = 0.0  # one codebook's columns: every 8th
    counter = dev_int(0, torch.int64)
    draws = samp.sample_top_k(logits, counter, seed=5, temperature=1.3, top_k=20, mask=mask,
                              num_samples=2048)  # fmt: skip
    assert bool((draws % 8 == 0).all())
    _assert_distribution(draws, samp.top_k_probs_ref(logits, temperature=1.3, top_k=20, mask=mask))


def test_sampler_counter_drives_randomness() -> None:
    logits = randn(100, scale=0.1)  # nearly flat over the top 30: repeats would be visible
    counter = dev_int(0, torch.int64)
    a = torch.cat([samp.sample_top_k(logits, counter, seed=9) for _ in range(12)])
    assert int(counter) == 12 and len(set(a.tolist())) > 4
    counter.fill_(0)
    b = torch.cat([samp.sample_top_k(logits, counter, seed=9) for _ in range(12)])
    assert torch.equal(a, b)  # (seed, counter) reproduces the draws
    counter.fill_(0)
    c = torch.cat([samp.sample_top_k(logits, counter, seed=10) for _ in range(12)])
    assert not torch.equal(a, c)


def test_sampler_edge_cases() -> None:
    logits = randn(300)
    counter = dev_int(0, torch.int64)
    only = samp.sample_top_k(logits, counter, seed=1, allowed=(0, 0), extra_allowed=17)
    assert int(only) == 17
    none = samp.sample_top_k(logits, counter, seed=1, allowed=(0, 0))
    assert int(none) == -1
    few = samp.sample_top_k(logits, counter, seed=1, allowed=(40, 43), num_samples=64)
    assert bool(((few >= 40) & (few < 43)).all())
    nan_row = logits.clone()
    nan_row[:150] = float("nan")
    assert bool((samp.sample_top_k(nan_row, counter, seed=1, num_samples=64) >= 150).all())
    with pytest.raises(ValueError, match="top_k"):
        samp.sample_top_k(logits, counter, seed=1, top_k=200)
    with pytest.raises(ValueError, match="temperature"):
        samp.sample_top_k(logits, counter, seed=1, temperature=0.0)
    with pytest.raises(ValueError, match="counter"):
        samp.sample_top_k(logits, dev_int(0, torch.int32), seed=1)


# --------------------------------------------------------------------------- norm + rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_and_residual_add(dtype: torch.dtype) -> None:
    x, r = randn(3, 2048, dtype=dtype), randn(3, 2048, dtype=dtype)
    w = (torch.rand(2048, device=DEVICE) + 0.5).to(dtype)
    assert rel_err(rn.layer_norm(x, w), rn.layer_norm_ref(x, w)) < tol(dtype)
    xn, s = rn.add_layer_norm(x, r, w)
    xn_ref, s_ref = rn.add_layer_norm_ref(x, r, w)
    assert rel_err(s, s_ref) < tol(dtype) and rel_err(xn, xn_ref) < tol(dtype)
    odd = randn(1, 1000, dtype=dtype)  # width not a power of two
    w_odd = torch.ones(1000, device=DEVICE, dtype=dtype)
    assert rel_err(rn.layer_norm(odd, w_odd), rn.layer_norm_ref(odd, w_odd)) < tol(dtype)


def test_layer_norm_matches_cohere2_module() -> None:
    mod = require_or_skip("transformers.models.cohere2.modeling_cohere2")
    norm = mod.Cohere2LayerNorm(256, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(256) + 0.5)
        x = randn(2, 256)
        assert rel_err(rn.layer_norm(x, norm.weight), norm(x)) < 1e-5


def _packed_qkv(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as column views of one packed projection row (strided, as in decode)."""
    row = randn(1, 16 * 128 + 2 * 4 * 128 + 64, dtype=dtype)
    return (row[0, :2048].view(16, 128), row[0, 2048:2560].view(4, 128),
            row[0, 2560:3072].view(4, 128))  # fmt: skip


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write(rotary: bool, dtype: torch.dtype) -> None:
    cos, sin = rn.rope_cos_sin(512, dtype=dtype, device=DEVICE)
    q, k, v = _packed_qkv(dtype)
    kc, vc = randn(1, 4, 64, 128, dtype=dtype), randn(1, 4, 64, 128, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_out = rn.rope_and_cache_write(q, k, v, kc, vc, dev_int(37), cos, sin, rotary=rotary)
    q_ref = rn.rope_and_cache_write_ref(q, k, v, kc_ref, vc_ref, 37, cos, sin, rotary=rotary)
    assert rel_err(q_out, q_ref) < tol(dtype)
    assert rel_err(kc[:, :, 37], kc_ref[:, :, 37]) < tol(dtype)
    assert torch.equal(vc[:, :, 37], v[None])  # v is copied, never rotated
    others = torch.ones(64, dtype=torch.bool)
    others[37] = False
    assert torch.equal(kc[:, :, others], kc_ref[:, :, others])  # only row 37 written
    assert torch.equal(vc[:, :, others], vc_ref[:, :, others])
    if not rotary:
        assert torch.equal(q_out, q) and torch.equal(kc[0, :, 37], k)


def test_rope_matches_transformers_cohere2() -> None:
    mod = require_or_skip("transformers.models.cohere2.modeling_cohere2")
    cos, sin = rn.rope_cos_sin(4096, theta=50000.0, dtype=torch.float32, device=DEVICE)
    q, k, v = _packed_qkv(torch.float32)
    kc = vc = torch.zeros(4, 8, 128, device=DEVICE)
    for pos in (0, 1, 3001):
        c = cos[pos].repeat_interleave(2)[None, None]  # [1, 1, D] as Cohere2RotaryEmbedding
        s = sin[pos].repeat_interleave(2)[None, None]
        q_hf, _ = mod.apply_rotary_pos_emb(q[None, :, None], k[None, :, None], c, s)
        q_out = rn.rope_and_cache_write(q, k, v, kc, vc, dev_int(pos), cos, sin)
        assert rel_err(q_out, q_hf[0, :, 0]) < 1e-6


def test_rope_table_matches_transformers_rotary_embedding() -> None:
    mod = require_or_skip("transformers.models.cohere2.modeling_cohere2")
    cfg_mod = require_or_skip("transformers.models.cohere2.configuration_cohere2")
    config = cfg_mod.Cohere2Config(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )  # fmt: skip
    emb = mod.Cohere2RotaryEmbedding(config).to(DEVICE)
    positions = torch.tensor([[0, 5, 4095, 8191]], device=DEVICE)
    x = torch.zeros(1, device=DEVICE, dtype=torch.bfloat16)
    cos_hf, sin_hf = emb(x, positions)
    cos, sin = rn.rope_cos_sin(8192, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(cos[positions[0]].repeat_interleave(2, -1), cos_hf[0])
    assert torch.equal(sin[positions[0]].repeat_interleave(2, -1), sin_hf[0])


def test_rope_position_outside_cache_writes_nothing_and_in_place_q() -> None:
    cos, sin = rn.rope_cos_sin(64, dtype=torch.float32, device=DEVICE)
    q, k, v = randn(16, 128), randn(4, 128), randn(4, 128)
    kc, vc = randn(4, 16, 128), randn(4, 16, 128)
    before = kc.clone(), vc.clone()
    q_ref = rn.rotary_ref(q, 20, cos, sin)
    rn.rope_and_cache_write(q, k, v, kc, vc, dev_int(20), cos, sin, q_out=q)  # in place
    assert rel_err(q, q_ref) < 1e-6
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    with pytest.raises(ValueError, match="pos must be a one-element"):
        rn.rope_and_cache_write(q, k, v, kc, vc, 3, cos, sin)  # type: ignore[arg-type]


# ------------------------------------------------ fused_rope_norm in the decoder (tiny model)


def _teacher_forced(model, names, prompt, tokens, **params):
    from orchestrate.api.config import StackSpec, TechniqueRef
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik import fidelity

    FAMILY = get_family("rumik")
    from orchestrate.api.registry import build_stack

    spec = StackSpec(
        name="t", techniques=[TechniqueRef(name=n, params=params.get(n, {})) for n in names]
    )
    return fidelity.teacher_forced(FAMILY.build_engine(model, build_stack(spec)), prompt, tokens)


@pytest.fixture(scope="module")
def fused_case():
    """The tiny model (fp32), a prompt and 72 stock tokens: the cache crosses the window."""
    from orchestrate.api.config import ModelSpec, SamplingConfig
    from orchestrate.api.registry import get_family
    from orchestrate.families.rumik import fidelity

    FAMILY = get_family("rumik")
    from orchestrate.families.rumik.engine import stock_engine
    from orchestrate.families.rumik.vocab import build_prompt

    model = FAMILY.build_model(ModelSpec(preset="tiny", device=DEVICE.type))
    prompt = model.encode_prompt(build_prompt("A short test sentence.", "Ira", "neutral"))
    eng = stock_engine(model)
    with torch.inference_mode():
        gen = torch.Generator(device=DEVICE).manual_seed(7)
        tokens = eng.loop(eng, prompt, 9, SamplingConfig(), gen).tokens
    assert len(prompt) + len(tokens) > model.config.sliding_window
    return model, prompt, tokens, fidelity.teacher_forced(eng, prompt, tokens)


@pytest.mark.parametrize(
    "names",
    [["static_kv_cache", "fused_rope_norm"],  # stock projections: residual, then the norm
     ["static_kv_cache", "packed_projections", "fused_rope_norm"]],  # add + norm fused
    ids="+".join,
)  # fmt: skip
def test_fused_rope_norm_matches_stock(fused_case, names) -> None:
    from orchestrate.families.rumik import fidelity

    model, prompt, tokens, ref = fused_case
    other = _teacher_forced(model, names, prompt, tokens)
    rec = fidelity.compare(ref, other, 0.8, 30, torch.float32)
    assert rec.within_tolerance and rec.top1_agreement == 1.0, rec


def test_fused_rope_norm_composes_with_int8(fused_case, monkeypatch) -> None:
    """int8 + fused glue gives the logits of int8 alone: the fusion changes nothing else."""
    model, prompt, tokens, _ = fused_case
    # few, wide programs: the interpreter's cost is per program
    monkeypatch.setattr(gemv, "default_config", lambda n, k: gemv.GemvConfig(128, 128))
    plain = _teacher_forced(model, ["static_kv_cache", "int8_projections"], prompt, tokens[:8])
    fused = _teacher_forced(model, ["static_kv_cache", "int8_projections", "fused_rope_norm"],
                            prompt, tokens[:8])  # fmt: skip
    assert rel_err(fused, plain) < 1e-5
    # the same without the SwiGLU + pack kernel: that kernel is what the default adds
    no_swiglu = _teacher_forced(
        model,
        ["static_kv_cache", "int8_projections", "fused_rope_norm"],
        prompt,
        tokens[:8],
        fused_rope_norm={"swiglu": False},
    )
    assert rel_err(no_swiglu, fused) < 1e-5
    calls = []
    monkeypatch.setattr(sw, "swiglu_cat", lambda *a, **k: calls.append(1) or sw.swiglu_cat_ref(
        *a))  # fmt: skip
    _teacher_forced(model, ["static_kv_cache", "int8_projections", "fused_rope_norm"], prompt,
                    tokens[:2])  # fmt: skip
    assert calls, "the decoder did not use swiglu_cat"


def test_int8_preload_changes_no_logit(fused_case, monkeypatch) -> None:
    """int8_projections' preload is a launch option: the same logits, and it reaches the
    kernel's config (a config with prefetch refuses it rather than ignore it)."""
    model, prompt, tokens, _ = fused_case
    monkeypatch.setattr(gemv, "default_config", lambda n, k: gemv.GemvConfig(64, 128))
    names = ["static_kv_cache", "int8_projections", "fused_rope_norm"]
    plain = _teacher_forced(model, names, prompt, tokens[:4])
    seen: list[bool] = []
    launch = gemv._launch_gemv
    monkeypatch.setattr(gemv, "_launch_gemv", lambda x, q, s, o, cfg, pdl, xs=None, r=None:
        seen.append(cfg.preload) or launch(x, q, s, o, cfg, pdl, xs, r))  # fmt: skip
    pre = _teacher_forced(model, names, prompt, tokens[:4], int8_projections={"preload": True})
    assert seen and all(seen)
    assert torch.equal(pre, plain) if not CUDA else rel_err(pre, plain) < 1e-6
    prefetching = gemv.GemvConfig(64, 128, prefetch=True)
    monkeypatch.setattr(gemv, "default_config", lambda n, k: prefetching)
    with pytest.raises(ValueError, match="preload and prefetch"):
        _teacher_forced(model, names, prompt, tokens[:2], int8_projections={"preload": True})


def test_int8_gemv_configs_table_reaches_the_kernel(fused_case, monkeypatch) -> None:
    """int8_projections' gemv_configs picks a table's config for every decode GEMV (here a
    reduce_each one: the same logits up to the summation order); an unknown table is refused
    when the stack is read, not at the first launch."""
    from orchestrate.techniques.rumik.int8_projections import Int8Params

    model, prompt, tokens, _ = fused_case
    monkeypatch.setattr(gemv, "default_config", lambda n, k: gemv.GemvConfig(64, 128))
    names = ["static_kv_cache", "int8_projections", "fused_rope_norm"]
    plain = _teacher_forced(model, names, prompt, tokens[:4])

    class EveryShape(dict):  # the tiny model's shapes are not the real ones
        def get(self, key: object, default: object = None) -> gemv.GemvConfig:
            return gemv.GemvConfig(64, 128, reduce_each=True)

    monkeypatch.setitem(gemv.GEMV_TABLES, "pdl_tuned", EveryShape())
    seen: list[bool] = []
    launch = gemv._launch_gemv
    monkeypatch.setattr(gemv, "_launch_gemv", lambda x, q, s, o, cfg, pdl, xs=None, r=None:
        seen.append(cfg.reduce_each) or launch(x, q, s, o, cfg, pdl, xs, r))  # fmt: skip
    each = _teacher_forced(model, names, prompt, tokens[:4],
                           int8_projections={"gemv_configs": "pdl_tuned"})  # fmt: skip
    assert seen and all(seen)
    assert rel_err(each, plain) < 1e-4
    assert CUDA or not torch.equal(each, plain)  # the interpreter shows the other roundings
    with pytest.raises(ValueError, match="gemv_configs"):
        Int8Params(gemv_configs="s99")


def test_fused_rope_norm_refuses_unsupported() -> None:
    from orchestrate.api.technique import UnsupportedConfig
    from orchestrate.techniques.rumik.fused_rope_norm import check_supported

    with pytest.raises(UnsupportedConfig, match="head_dim must be an even power of two"):
        check_supported(1024, 8, 2, 96)
    with pytest.raises(UnsupportedConfig, match="at most 64"):
        check_supported(1024, 80, 2, 128)
    from orchestrate.api.config import StackSpec, TechniqueRef
    from orchestrate.api.registry import StackError, build_stack

    spec = StackSpec(name="t", techniques=[
        TechniqueRef(name="static_kv_cache", params={"compile": True}),
        TechniqueRef(name="fused_rope_norm")])  # fmt: skip
    with pytest.raises(StackError, match="without compile"):
        build_stack(spec)


def test_int6_projections_approximate_and_composes(fused_case, monkeypatch) -> None:
    """int6 moves the logits (more than int8 would), and fused glue on top changes nothing."""
    from orchestrate.api.registry import StackError, build_stack
    from orchestrate.families.rumik import fidelity

    model, prompt, tokens, ref = fused_case
    monkeypatch.setattr(g6, "default_config", lambda n, k: g6.Int6Config(128, 32))
    monkeypatch.setattr(gemv, "default_config", lambda n, k: gemv.GemvConfig(128, 128))
    n = 8
    six = _teacher_forced(model, ["static_kv_cache", "int6_projections"], prompt, tokens[:n])
    eight = _teacher_forced(model, ["static_kv_cache", "int8_projections"], prompt, tokens[:n])
    rec6 = fidelity.compare(ref[:n], six, 0.8, 30, torch.float32)
    rec8 = fidelity.compare(ref[:n], eight, 0.8, 30, torch.float32)
    assert not rec6.within_tolerance and rec6.max_abs_logit_diff > rec8.max_abs_logit_diff
    assert rec6.top1_agreement >= 0.75, rec6
    fused = _teacher_forced(model, ["static_kv_cache", "int6_projections", "fused_rope_norm"],
                            prompt, tokens[:n])  # fmt: skip
    assert rel_err(fused, six) < 1e-5
    from orchestrate.api.config import StackSpec, TechniqueRef

    both = StackSpec(name="t", techniques=[TechniqueRef(name=t) for t in
                     ("static_kv_cache", "int8_projections", "int6_projections")])  # fmt: skip
    with pytest.raises(StackError, match="conflicts with 'int8_projections'"):
        build_stack(both)


# --------------------------------------------------------------------------- SwiGLU + pack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_cat_matches_eager(dtype: torch.dtype) -> None:
    """Column views of one packed projection output, as the decoder passes them."""
    y = randn(1, 1, 96 + 2 * 1500, dtype=dtype, scale=3.0)
    attn_row = randn(1, 1, 2048, dtype=dtype)
    gate, up = y[..., 96:1596], y[..., 1596:]
    out = sw.swiglu_cat(attn_row, gate, up)
    ref = sw.swiglu_cat_ref(attn_row, gate, up)
    assert out.shape == ref.shape == (1, 1, 2048 + 1500)
    assert torch.equal(out[..., :2048], attn_row)  # the copy is exact
    # fp32: the same maths; bf16: the interpreter truncates each of the two roundings (up to
    # one bf16 ulp each), the GPU rounds to nearest as eager does (exp may differ in an ulp)
    bound = 1e-6 if dtype == torch.float32 else (2e-3 if CUDA else tol(dtype))
    assert rel_err(out[..., 2048:], ref[..., 2048:]) < bound


def test_swiglu_cat_rejects_unsupported() -> None:
    a, g = randn(1, 64), randn(1, 32)
    with pytest.raises(ValueError, match="one row"):
        sw.swiglu_cat(randn(2, 64), g, g)
    with pytest.raises(ValueError, match="differ"):
        sw.swiglu_cat(a, g, randn(1, 16))
    with pytest.raises(ValueError, match="share a dtype"):
        sw.swiglu_cat(a, g, g.half())
    with pytest.raises(ValueError, match="contiguous last dim"):
        sw.swiglu_cat(a, randn(1, 64)[:, ::2], g)


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@gpu
def test_gpu_real_shapes_graphs_and_pdl() -> None:
    """Real shapes, CUDA-graph replay with device-side length/position/counter, and PDL."""
    torch.manual_seed(0)
    w = randn(25088, 2048, dtype=torch.bfloat16, scale=0.02)
    q8, scale = gemv.quantize_int8(w)
    x = randn(1, 2048, dtype=torch.bfloat16)
    for pdl in (False, True):
        y = gemv.int8_linear(x, q8, scale, launch_pdl=pdl)
        assert rel_err(y, gemv.int8_linear_ref(x, q8, scale)) < 1e-2
    w2 = randn(2048, 13056, dtype=torch.bfloat16, scale=0.02)
    q2, s2 = gemv.quantize_int8(w2)
    x2 = randn(1, 13056, dtype=torch.bfloat16)
    y2 = gemv.int8_linear(x2, q2, s2, config=gemv.GemvConfig(8, 256, 4, split_k=4))
    assert rel_err(y2, gemv.int8_linear_ref(x2, q2, s2)) < 1e-2

    qa = randn(1, 16, 128, dtype=torch.bfloat16)
    k, v = _kv(8192, 8192, torch.bfloat16)
    length = dev_int(1)
    counter = dev_int(0, torch.int64)
    logits = randn(277404, dtype=torch.bfloat16, scale=3.0)
    out = torch.empty_like(qa)
    tok = torch.empty(1, dtype=torch.int64, device=DEVICE)
    step = lambda: (  # noqa: E731
        attn.decode_attention(qa, k, v, length, window=4096, out=out, launch_pdl=True),
        samp.sample_top_k(logits, counter, seed=3, out=tok, launch_pdl=True),
    )
    step()  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    counter.zero_()
    seen = []
    for n in (1, 100, 4097, 8192):
        length.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        ref = attn.decode_attention_ref(qa, k, v, n, window=4096)
        assert rel_err(out, ref) < 1e-2
        seen.append(int(tok))
    assert int(counter) == 4
    support = samp.top_k_probs_ref(logits) > 0
    assert all(bool(support[t]) for t in seen)


def _launch_all(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, cfgs: Any,
                outs: list[torch.Tensor]) -> None:  # fmt: skip
    for c, o in zip(cfgs, outs, strict=True):
        gemv.int8_linear(x, q, scale, config=c, out=o, launch_pdl=True)


@pytest.mark.gpu
@gpu
def test_gpu_tma_gemv_real_shapes_in_graph_with_pdl() -> None:
    """Every TMA candidate at Rumik's two decode shapes, back to back in one captured graph
    with PDL: each within bf16 rounding of the reference and of the pointer kernel with the
    same tile and split (the same products; the last reduction follows the register layout)."""
    torch.manual_seed(0)
    for (n, k), cfgs in gemv.TMA_CONFIGS.items():
        q, scale = gemv.quantize_int8(randn(n, k, dtype=torch.bfloat16, scale=0.02))
        x = randn(1, k, dtype=torch.bfloat16)
        ref = gemv.int8_linear_ref(x, q, scale)
        outs = [torch.empty(1, n, dtype=torch.bfloat16, device=DEVICE) for _ in cfgs]
        run = functools.partial(_launch_all, x, q, scale, cfgs, outs)
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for c, o in zip(cfgs, outs, strict=True):
            assert rel_err(o, ref) < 1e-2, c
            plain = gemv.GemvConfig(c.block_n, c.block_k, c.num_warps, split_k=c.split_k,
                                    magic=True)  # fmt: skip
            assert rel_err(o, gemv.int8_linear(x, q, scale, config=plain)) < 1e-3, c


@pytest.mark.gpu
@gpu
def test_gpu_length_offset_and_swiglu_in_graph() -> None:
    """Real shapes inside one captured graph: attention reading the length as position + 1
    on the device, then the SwiGLU + pack kernel on its output, with PDL."""
    torch.manual_seed(1)
    qa = randn(1, 16, 128, dtype=torch.bfloat16)
    k, v = _kv(8192, 8192, torch.bfloat16)
    position = dev_int(0)
    out = torch.empty_like(qa)
    y = randn(1, 1, 25088, dtype=torch.bfloat16, scale=3.0)
    gate, up = y[..., 3072:14080], y[..., 14080:]
    packed: list[torch.Tensor] = []
    step = lambda: (  # noqa: E731
        attn.decode_attention(qa, k, v, position, length_offset=1, window=4096, out=out,
                              launch_pdl=True),
        packed.append(sw.swiglu_cat(out.view(1, 1, 2048), gate, up, launch_pdl=True)),
    )  # fmt: skip
    step()  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for n in (1, 100, 4097, 8192):
        position.fill_(n - 1)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, attn.decode_attention_ref(qa, k, v, n, window=4096)) < 1e-2
        ref = sw.swiglu_cat_ref(out.view(1, 1, 2048), gate, up)
        assert torch.equal(packed[-1][..., :2048], ref[..., :2048])
        # eager rounds twice to nearest; the kernel too: all but ulp-level exp differences
        same = (packed[-1] == ref).float().mean().item()
        assert same > 0.99, same


# --------------------------------------------------------------------------- fused GEMVs


def _same(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise under the interpreter; compiled, a row's fp32 sum may be reduced in another
    order (the fused kernels' tiles differ): then all but rounding-level differences."""
    if not CUDA:
        assert torch.equal(out, ref)
        return
    same = (out == ref).float().mean().item()
    assert rel_err(out, ref) < (1e-6 if out.dtype == torch.float32 else 1e-2), same
    # bf16: most values round to the same bits. fp32 (the rel_err bound above says rounding
    # level): 31-33% of them were bitwise equal on an H100, so no share is asked of it.
    if out.dtype != torch.float32:
        assert same > 0.9, same


def _qkvgu_case(dtype: torch.dtype, k: int = 80):
    """Packed [q | k | v | gate | up] weights of 4 query and 2 KV heads of 16, and caches."""
    d, hq, hkv, f = 16, 4, 2, 48
    qw, sc = gemv.quantize_int8(randn(hq * d + 2 * hkv * d + 2 * f, k))
    cache = torch.zeros(1, hkv, 32, d, dtype=dtype, device=DEVICE)
    cos, sin = rn.rope_cos_sin(32, d, dtype=dtype, device=DEVICE)
    return qw, sc, cache, cos, sin, hq * d, hkv * d


@pytest.mark.parametrize("preload", [True, False])
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_rope_act_equals_gemv_rope_swiglu(
    dtype: torch.dtype, rotary: bool, preload: bool
) -> None:
    """The input GEMV with the rotary + SwiGLU epilogue (its gate and up rows interleaved)
    gives what int8_linear, rope_and_cache_write and swiglu_cat give on the plain order: the
    rotated q, k and v in the cache row, silu(gate) * up (K=80 over chunks of 32: the masked
    tail too)."""
    qw, sc, cache, cos, sin, q_size, kv_size = _qkvgu_case(dtype)
    x, pos, cfg = randn(1, 80, dtype=dtype), dev_int(5), gemv.GemvConfig(8, 32, 4, magic=True)
    y = gemv.int8_linear(x, qw, sc, config=cfg)[0]
    kc, vc = cache.clone(), cache.clone()
    qkv = q_size + 2 * kv_size
    q_ref = rn.rope_and_cache_write(
        y[:q_size], y[q_size : q_size + kv_size], y[q_size + kv_size : qkv], kc, vc, pos, cos,
        sin, rotary=rotary,
    )  # fmt: skip
    f = (y.shape[0] - qkv) // 2
    act_ref = sw.swiglu_cat(y[:0], y[qkv : qkv + f], y[qkv + f :])
    qi, si = fg.interleave_gate_up(qw, qkv), fg.interleave_gate_up(sc, qkv)
    assert torch.equal(qi[qkv : qkv + 2], torch.stack([qw[qkv], qw[qkv + f]]))  # (g_0, u_0)
    kc2, vc2 = cache.clone(), cache.clone()
    q_out, act = fg.int8_linear_rope_act(x[0], qi, si, pos, cos, sin, kc2, vc2, q_size=q_size,
                                         kv_size=kv_size, rotary=rotary, config=cfg,
                                         preload=preload)  # fmt: skip
    _same(q_out, q_ref.reshape(-1))
    _same(act, act_ref)
    _same(kc2[0, :, 5], kc[0, :, 5])
    _same(vc2[0, :, 5], vc[0, :, 5])
    assert kc2[0, :, 5].abs().sum() > 0 and kc2[0, :, 4].abs().sum() == 0  # row 5 alone
    # a position outside the cache writes no row there
    kc3, vc3 = cache.clone(), cache.clone()
    fg.int8_linear_rope_act(x[0], qi, si, dev_int(32), cos, sin, kc3, vc3, q_size=q_size,
                            kv_size=kv_size, config=cfg)  # fmt: skip
    assert kc3.abs().sum() == 0 and vc3.abs().sum() == 0


@pytest.mark.parametrize("preload", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_cat_equals_gemv_of_the_concatenation(dtype: torch.dtype, preload: bool):
    """The output GEMV reading cat([attn, act]) from the two rows gives the GEMV of the stored
    concatenation (A=48 is not a multiple of the 32-wide chunks: a chunk straddles both rows,
    and K=148 ends in a partial chunk)."""
    qw, sc = gemv.quantize_int8(randn(32, 48 + 100))
    attn, act = randn(1, 48, dtype=dtype), randn(1, 100, dtype=dtype)
    cfg = gemv.GemvConfig(8, 32, 4, magic=True)
    ref = gemv.int8_linear(torch.cat([attn, act], -1), qw, sc, config=cfg)[0]
    _same(fg.int8_linear_cat(attn[0], act[0], qw, sc, config=cfg, preload=preload), ref)


def test_fused_gemvs_reject_unsupported() -> None:
    qw, sc, cache, cos, sin, q_size, kv_size = _qkvgu_case(torch.float32)
    x, pos = randn(80), dev_int(3)

    def rope_act(*args: object, **kw: object) -> object:
        kw = {"q_size": q_size, "kv_size": kv_size, **kw}
        return fg.int8_linear_rope_act(*args, **kw)

    with pytest.raises(ValueError, match="block_n must be even"):
        rope_act(x, qw, sc, pos, cos, sin, cache, cache.clone(), config=gemv.GemvConfig(1, 32))
    with pytest.raises(ValueError, match="whole heads"):
        rope_act(x, qw, sc, pos, cos, sin, cache, cache.clone(), kv_size=kv_size - 8)
    with pytest.raises(ValueError, match="gate/up pairs"):
        rope_act(x, *gemv.quantize_int8(randn(q_size + 2 * kv_size + 3, 80)), pos, cos, sin,
                 cache, cache.clone())  # fmt: skip
    with pytest.raises(ValueError, match="one row"):
        rope_act(randn(2, 80), qw, sc, pos, cos, sin, cache, cache.clone())
    with pytest.raises(ValueError, match="pos"):
        rope_act(x, qw, sc, 3, cos, sin, cache, cache.clone())
    with pytest.raises(ValueError, match="not gate \\+ up"):
        fg.interleave_gate_up(qw, 1)
    with pytest.raises(ValueError, match="multiple of the config's block_n"):
        q30 = gemv.quantize_int8(randn(30, 164))
        fg.int8_linear_cat(randn(64), randn(100), *q30, config=gemv.GemvConfig(8, 64))
    with pytest.raises(ValueError, match=r"q must be \[N, 164\]"):
        fg.int8_linear_cat(randn(64), randn(100), qw, sc)


def test_fused_rope_norm_into_gemv_gives_int8s_logits(fused_case, monkeypatch) -> None:
    """int8 + fused glue folded into the GEMVs gives the logits of int8 + fused glue, and the
    two launches it folds in are never called."""
    model, prompt, tokens, _ = fused_case
    monkeypatch.setattr(gemv, "default_config", lambda n, k: gemv.GemvConfig(64, 128))
    names = ["static_kv_cache", "int8_projections", "fused_rope_norm"]
    # four tokens: every launch of a decode step, at a quarter of the interpreter's minutes
    plain = _teacher_forced(model, names, prompt, tokens[:4])

    def never(*a: object, **k: object) -> None:
        raise AssertionError("into_gemv launched a kernel it folds in")

    monkeypatch.setattr(rn, "rope_and_cache_write", never)
    monkeypatch.setattr(sw, "swiglu_cat", never)
    for preload in (True, False):
        params = {"into_gemv": True, "preload": preload}
        folded = _teacher_forced(model, names, prompt, tokens[:4], fused_rope_norm=params)
        assert torch.equal(folded, plain) if not CUDA else rel_err(folded, plain) < 1e-5


@pytest.mark.parametrize("projections", ["int6_projections", "packed_projections"])
def test_into_gemv_refused_without_fused_gemvs(fused_case, projections) -> None:
    from orchestrate.api.technique import UnsupportedConfig

    model, prompt, tokens, _ = fused_case
    with pytest.raises(UnsupportedConfig, match="into_gemv needs projections with fused GEMVs"):
        _teacher_forced(model, ["static_kv_cache", projections, "fused_rope_norm"], prompt,
                        tokens[:2], fused_rope_norm={"into_gemv": True})  # fmt: skip


@gpu
def test_gpu_fused_gemvs_real_shapes_in_graph_with_pdl() -> None:
    """Rumik OSS 1's decode shapes (25088 x 2048 in, 2048 x 13056 out; 16 query and 4 KV heads
    of 128) in one captured graph with PDL: the fused GEMVs against int8_linear followed by
    rope_and_cache_write and swiglu_cat, at positions read from device memory."""
    torch.manual_seed(2)
    bf = torch.bfloat16
    w_in = gemv.quantize_int8(randn(25088, 2048, scale=0.02).to(bf))
    w_in_pairs = tuple(fg.interleave_gate_up(t, 3072) for t in w_in)
    w_out = gemv.quantize_int8(randn(2048, 13056, scale=0.02).to(bf))
    x, attn_row = randn(2048, dtype=bf), randn(2048, dtype=bf)
    caches = [torch.zeros(1, 4, 8192, 128, dtype=bf, device=DEVICE) for _ in range(4)]
    cos, sin = rn.rope_cos_sin(8192, 128, device=DEVICE)
    pos = dev_int(0)
    got: dict[str, torch.Tensor] = {}

    def step() -> None:
        y = gemv.int8_linear(x, *w_in, launch_pdl=True)
        got["q"] = rn.rope_and_cache_write(y[:2048], y[2048:2560], y[2560:3072], caches[0],
                                           caches[1], pos, cos, sin, launch_pdl=True)  # fmt: skip
        row = sw.swiglu_cat(attn_row, y[3072:14080], y[14080:], launch_pdl=True)
        got["act"] = row[2048:]
        got["o"] = gemv.int8_linear(row, *w_out, launch_pdl=True)
        got["q2"], got["act2"] = fg.int8_linear_rope_act(
            x, *w_in_pairs, pos, cos, sin, caches[2], caches[3], q_size=2048, kv_size=512,
            launch_pdl=True,
        )  # fmt: skip
        got["o2"] = fg.int8_linear_cat(attn_row, got["act2"], *w_out, launch_pdl=True)

    step()  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for p in (0, 4097, 8191):
        pos.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        _same(got["q2"], got["q"].reshape(-1))
        _same(got["act2"], got["act"])
        _same(caches[2][0, :, p], caches[0][0, :, p])
        _same(caches[3][0, :, p], caches[1][0, :, p])
        _same(got["o2"], got["o"])
    assert torch.equal(caches[2][0, :, 1], torch.zeros_like(caches[2][0, :, 1]))  # untouched row


# --------------------------------------------------------------------------- OmniVoice q/k


def _qkv_case(b: int, s: int, hq: int, hkv: int, d: int, dtype: torch.dtype, cos_b: int):
    extra = 3  # columns past q|k|v: the kernel must read by stride, not assume packing
    qkv = randn(b, s, (hq + 2 * hkv) * d + extra, dtype=dtype)[..., : (hq + 2 * hkv) * d]
    qw, kw = (randn(d, dtype=dtype) for _ in range(2))
    ang = torch.rand(cos_b, s, d // 2, device=DEVICE) * 6.0
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype).contiguous()
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype).contiguous()
    return qkv, qw, kw, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("b", "s", "hq", "hkv", "d", "cos_b"),
    [(2, 5, 4, 2, 16, 1), (2, 3, 3, 1, 8, 2), (1, 7, 2, 2, 12, 1)],
)
def test_qk_norm_rope_matches_qwen3(dtype, b, s, hq, hkv, d, cos_b) -> None:
    """Per-head RMSNorm + rotate-half rotary of q and k, written [B, H, S, D]: transformers'
    Qwen3 path (q_norm/k_norm, transpose, apply_rotary_pos_emb); heads and half-dims that are
    not powers of two, a cos table per batch row or shared, qkv a strided view."""
    case = _qkv_case(b, s, hq, hkv, d, dtype, cos_b)
    q, k = qkr.qk_norm_rope(*case, 1e-6, hq, hkv)
    rq, rk = qkr.qk_norm_rope_ref(*case, 1e-6, hq, hkv)
    assert q.shape == (b, hq, s, d) and k.shape == (b, hkv, s, d) and q.is_contiguous()
    assert rel_err(q, rq) < tol(dtype) and rel_err(k, rk) < tol(dtype)
    if dtype == torch.float32:
        assert (q - rq).abs().max() < 1e-5 and (k - rk).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("b", "s", "hq", "hkv", "d", "cos_b"),
    [(2, 5, 4, 2, 16, 1), (2, 3, 3, 1, 8, 2), (1, 7, 2, 2, 12, 1), (1, 4, 8, 2, 8, 1)],
)
def test_qkv_norm_rope_writes_what_repeat_kv_would(dtype, b, s, hq, hkv, d, cos_b) -> None:
    """The second form: q and k as above, v from the next columns, and k and v repeated to
    the q heads in transformers' repeat_kv order (kv head j serves q heads j*r .. j*r+r-1),
    so a kernel that tiled the copies (j, j+hkv, ...) fails here. Tokens-major: contiguous
    [B, S, H, D], every element where that layout puts it (a kernel writing by the
    heads-major strides into it would scramble heads and tokens when S > 1 and H > 1);
    heads-major: contiguous [B, H, S, D], the same values."""
    case = _qkv_case(b, s, hq, hkv, d, dtype, cos_b)
    tokens_major = qkr.qkv_norm_rope(*case, 1e-6, hq, hkv)
    heads_major = qkr.qkv_norm_rope(*case, 1e-6, hq, hkv, tokens_major=False)
    ref = qkr.qkv_norm_rope_ref(*case, 1e-6, hq, hkv)
    assert all(t.shape == (b, s, hq, d) and t.is_contiguous() for t in tokens_major)
    got = [t.transpose(1, 2) for t in tokens_major]
    for g, hm, r in zip(got, heads_major, ref, strict=True):
        assert g.shape == hm.shape == (b, hq, s, d) and hm.is_contiguous()
        assert rel_err(g, r) < tol(dtype)
        assert torch.equal(g, hm)
    assert torch.equal(got[2], ref[2])  # v is copied, not computed
    q, k = qkr.qk_norm_rope(*case, 1e-6, hq, hkv)  # the first form's q and k, unrepeated
    assert torch.equal(got[0], q)
    assert torch.equal(got[1][:, :: hq // hkv], k)


def test_qkv_norm_rope_refuses_heads_it_cannot_repeat() -> None:
    qkv, qw, kw, cos, sin = _qkv_case(1, 4, 3, 2, 8, torch.float32, 1)
    with pytest.raises(ValueError, match="not a multiple"):
        qkr.qkv_norm_rope(qkv, qw, kw, cos, sin, 1e-6, 3, 2)
    q, k = qkr.qk_norm_rope(qkv, qw, kw, cos, sin, 1e-6, 3, 2)  # the first form needs none
    assert q.shape[1] == 3 and k.shape[1] == 2


def test_qk_norm_rope_uses_each_norm_weight_and_eps() -> None:
    """A kernel that swapped the q and k weights, or ignored eps, fails this."""
    qkv, qw, kw, cos, sin = _qkv_case(1, 4, 2, 2, 8, torch.float32, 1)
    qkv = qkv * 1e-3  # tiny rows: eps matters
    q, k = qkr.qk_norm_rope(qkv, qw, kw * 3.0, cos, sin, 1e-5, 2, 2)
    rq, rk = qkr.qk_norm_rope_ref(qkv, qw, kw * 3.0, cos, sin, 1e-5, 2, 2)
    assert rel_err(q, rq) < 1e-5 and rel_err(k, rk) < 1e-5
    q0, _ = qkr.qk_norm_rope(qkv, qw, kw, cos, sin, 1e-2, 2, 2)
    assert rel_err(q0, rq) > 1e-2  # a different eps gives a different result


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"d": 7}, "even"),
        ({"hq": 40}, "do not fit"),
        ({"cos_s": 3}, "cos must be contiguous"),
        ({"weight_dtype": torch.bfloat16}, "norm weights must be"),
    ],
)
def test_qk_norm_rope_refuses_what_it_would_read_wrongly(change: dict, match: str) -> None:
    d = change.get("d", 8)
    qkv, qw, kw, cos, sin = _qkv_case(1, 4, 2, 1, 8, torch.float32, 1)
    if "d" in change:
        qw = kw = randn(d)
    if "cos_s" in change:
        cos = sin = cos[:, : change["cos_s"]].contiguous()
    if "weight_dtype" in change:
        qw = qw.to(change["weight_dtype"])
    with pytest.raises(ValueError, match=match):
        qkr.qk_norm_rope(qkv, qw, kw, cos, sin, 1e-6, change.get("hq", 2), 1)


def test_packed_backbone_with_the_fused_qk_kernel_matches_its_modules() -> None:
    """ov_packed_projections' forward with the kernel in place of q_norm/k_norm + rotary, on
    the tiny OmniVoice in fp32 (the interpreter): the same hidden states as the modules'
    path, so the kernel is wired to the right columns, heads, tables and eps."""
    from orchestrate.api.config import ModelSpec
    from orchestrate.api.registry import get_family
    from orchestrate.techniques.omnivoice.packed_projections import PackedBackbone

    model = get_family("omnivoice").build_model(
        ModelSpec(family="omnivoice", preset="tiny", device=DEVICE.type)
    )
    llm = model.ov.llm
    torch.manual_seed(0)
    with torch.no_grad():  # random init leaves the norms at 1: make q's and k's differ
        for layer in llm.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    embeds = torch.randn(2, 11, llm.config.hidden_size, device=DEVICE)
    mask = torch.ones(2, 1, 11, 11, dtype=torch.bool, device=DEVICE)
    mask[1, :, :, 8:] = False
    with torch.inference_mode():
        want = PackedBackbone(llm)(embeds, mask)
        got = PackedBackbone(llm, qkr.qk_norm_rope)(embeds, mask)
        got_qkv = PackedBackbone(llm, qkr.qkv_norm_rope, True, tokens_major=True)(embeds, mask)
        heads_major = functools.partial(qkr.qkv_norm_rope, tokens_major=False)
        got_hm = PackedBackbone(llm, heads_major, qkv_layout=True)(embeds, mask)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got_qkv, want) < 1e-5  # k, v repeated by the kernel, SDPA called directly
    assert rel_err(got_hm, want) < 1e-5
    heads = llm.layers[0].self_attn.config
    assert heads.num_attention_heads > heads.num_key_value_heads  # GQA: the repeat is tested
    # the small_gemm param: each of the four matmuls by the split-K kernel, alone and all
    cfg = sg.GemmConfig(block_m=16, block_n=16, block_k=16, split_k=2)
    gemm = functools.partial(sg.small_gemm, config=cfg)
    names = ("qkv", "o_proj", "gate_up", "down")
    with torch.inference_mode():
        for chosen in [(n,) for n in names] + [names]:
            tokens_major = PackedBackbone(llm, qkr.qkv_norm_rope, True, True,
                                          dict.fromkeys(chosen, gemm))  # fmt: skip
            assert rel_err(tokens_major(embeds, mask), want) < 1e-5, chosen
        modules_path = PackedBackbone(llm, gemms=dict.fromkeys(names, gemm))(embeds, mask)
    assert rel_err(modules_path, want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "split_k"),
    [(5, 40, 64, 1), (5, 40, 64, 2), (37, 24, 128, 4), (1, 16, 32, 1)],
)
def test_small_gemm_matches_the_product(dtype, m, n, k, split_k) -> None:
    """Rows and columns that do not fill a block (masked), K split into 1-4 ranges: the fp32
    product rounded once, within bf16's rounding; a split run twice gives the same bits."""
    cfg = sg.GemmConfig(block_m=16, block_n=16, block_k=16, split_k=split_k)
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype)
    out = sg.small_gemm(x, w, cfg)
    ref = sg.small_gemm_ref(x, w)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref) < tol(dtype)
    if dtype == torch.float32:
        assert (out - ref).abs().max() < 1e-4 * float(ref.abs().max())
    assert torch.equal(out, sg.small_gemm(x, w, cfg))
    strided = randn(m, k + 8, dtype=dtype)[:, :k]  # x a column slice: read by its row stride
    assert rel_err(sg.small_gemm(strided, w, cfg), sg.small_gemm_ref(strided, w)) < tol(dtype)


def test_small_gemm_refuses_a_split_that_leaves_a_partial_chunk() -> None:
    x, w = randn(4, 48), randn(8, 48)
    with pytest.raises(ValueError, match="does not split into 2 ranges"):
        sg.small_gemm(x, w, sg.GemmConfig(block_k=32, split_k=2))
    with pytest.raises(ValueError, match="x is"):
        sg.small_gemm(x, w.to(torch.bfloat16), sg.GemmConfig(block_k=16))


@gpu
def test_gpu_small_gemm_at_omnivoice_shapes() -> None:
    """bf16 on the H200 at the packed forward's four shapes (156 rows), every split the sweep
    times: the fp32 product within bf16 rounding, and as close to it as cuBLAS's bf16 GEMM."""
    torch.manual_seed(0)
    for n, k in sg.OV_SHAPES.values():
        x = torch.randn(156, k, device=DEVICE, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
        exact = x.float() @ w.float().T
        cublas = rel_err(torch.nn.functional.linear(x, w), exact)
        for split in (1, 2, 4, 8):
            cfg = sg.GemmConfig(block_m=64, block_n=64, block_k=64, split_k=split)
            err = rel_err(sg.small_gemm(x, w, cfg), exact)
            assert err < 1e-2 and err <= 1.5 * cublas, (n, k, split, err, cublas)


@gpu
def test_qk_norm_rope_op_inside_torch_compile() -> None:
    """The triton_op traced into a compiled graph gives the eager launch's result (bf16, the
    real head shape; bitwise: eps must reach the kernel as fp32 under compile too), and the
    eager Qwen3 path's within rounding."""
    case = _qkv_case(2, 37, 16, 8, 128, torch.bfloat16, 1)
    heads_major = functools.partial(qkr.qkv_norm_rope, tokens_major=False)
    forms = (
        (qkr.qk_norm_rope_op(), qkr.qk_norm_rope, qkr.qk_norm_rope_ref),
        (qkr.qkv_norm_rope_op(), qkr.qkv_norm_rope, qkr.qkv_norm_rope_ref),
        (qkr.qkv_norm_rope_op(False), heads_major, qkr.qkv_norm_rope_ref),
    )
    for form, (op, launch, reference) in enumerate(forms):
        compiled = torch.compile(lambda *a, op=op: op(*a, 1e-6, 16, 8), dynamic=False)
        got = compiled(*case)
        eager = launch(*case, 1e-6, 16, 8)
        ref = reference(*case, 1e-6, 16, 8)
        if launch is qkr.qkv_norm_rope:  # tokens-major [B, S, H, D]: compare as heads
            got, eager = ([t.transpose(1, 2) for t in ts] for ts in (got, eager))
        assert len(got) == len(ref)
        for i, (g, e, r) in enumerate(zip(got, eager, ref, strict=True)):
            where = (form, i, tuple(g.shape), g.stride(), tuple(e.shape), e.stride())
            assert g.shape == e.shape and g.stride() == e.stride(), where  # the layout kept
            assert torch.equal(g, e), (*where, float((g.float() - e.float()).abs().max()))
            assert rel_err(g, r) < 1e-2, where


# --------------------------------------------------------------------------- last: compiled


# --------------------------------------------------------------------------- ring attention


def _rings(rows: int, kv_heads: int, slots: int, d: int, dtype: torch.dtype = torch.float32):
    """Random rings with positions as MimiStream leaves them: row r holds its last positions
    in slots (position % slots), older slots unfilled (-1); the last row never written."""
    keys = randn(rows, kv_heads, slots, d, dtype=dtype)
    values = randn(rows, kv_heads, slots, d, dtype=dtype)
    filled = [5, slots + 3, 0, 2 * slots + 1][:rows]  # positions each row has written
    slot_position = torch.full((rows, slots), -1, dtype=torch.long, device=DEVICE)
    for r, n in enumerate(filled):
        for p in range(max(0, n - slots), n):
            slot_position[r, p % slots] = p
    return keys, values, slot_position, filled


@pytest.mark.parametrize("t,heads", [(2, 4), (5, 2), (1, 4)])
def test_ring_attention_reads_each_rows_ring_as_the_gathered_sdpa(t: int, heads: int) -> None:
    """Against the gather-mask-SDPA form MimiStream runs without it, in fp32: rows read out
    of order and twice, grouped heads, queries that see part of a window, and a row whose
    ring is empty (its queries see nothing: zeros)."""
    keys, values, slot_position, filled = _rings(4, 2, 20, 16)
    rows = torch.tensor([3, 1, 0, 1, 2], device=DEVICE)
    q_position = torch.stack(
        [torch.arange(filled[int(r)], filled[int(r)] + t) for r in rows.cpu()]
    ).to(DEVICE)
    for r, row in enumerate(rows.tolist()):  # the chunk's own keys are in the ring first
        for p in q_position[r].tolist():
            slot_position[row, p % 20] = p
    slot_position[2] = -1  # row 2: nothing written, not even the chunk's own keys
    q = randn(rows.numel(), heads, t, 16)
    out = ra.ring_attention(q, keys, values, rows, slot_position, q_position, 7, 0.25)
    ref = ra.ring_attention_ref(q, keys, values, rows, slot_position, q_position, 7, 0.25)
    assert out.shape == q.shape
    assert rel_err(out, ref) < 1e-5
    assert (out[4] == 0).all() and (out[:4].abs().sum(-1) > 0).all()  # out[4] reads row 2
    wider = ra.ring_attention(q, keys, values, rows, slot_position, q_position, 20, 0.25)
    assert rel_err(wider, out) > 1e-3  # the window bounds what a query sees


def test_ring_attention_refuses_what_it_would_read_wrongly() -> None:
    keys, values, slot_position, _ = _rings(3, 2, 8, 16)
    q, rows = randn(2, 4, 2, 16), torch.tensor([0, 1], device=DEVICE)
    pos = torch.zeros(2, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of the keys' heads"):
        ra.ring_attention(randn(2, 3, 2, 16), keys, values, rows, slot_position, pos, 4, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        k24 = randn(3, 2, 8, 24)
        ra.ring_attention(randn(2, 4, 2, 24), k24, k24, rows, slot_position, pos, 4, 1.0)
    with pytest.raises(ValueError, match="rows"):
        ra.ring_attention(q, keys, values, rows[:1], slot_position, pos, 4, 1.0)
    with pytest.raises(ValueError, match="contiguous last dim"):
        ra.ring_attention(q.transpose(-1, -2), keys, values, rows, slot_position, pos, 4, 1.0)


@pytest.mark.parametrize("window", [6, 250])
def test_a_stream_with_the_ring_kernel_decodes_as_the_whole_sequence(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MimiStream kv ring with the kernel reading its rings in place: three streams in
    different groupings and chunk lengths give the whole-sequence decode, and the ring
    without the kernel (tiny Mimi, fp32; on a GPU with TF32 off, as the bound is fp32's)."""
    from transformers import MimiConfig, MimiModel

    from orchestrate.api.family import seed_codebooks
    from orchestrate.families.rumik.mimi_stream import MimiStream
    from orchestrate.families.rumik.presets import TINY

    if CUDA:
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    with torch.device(DEVICE):
        model = MimiModel(MimiConfig(**{**TINY.mimi, "sliding_window": window})).eval()
        seed_codebooks(model)
    shape = (3, model.config.num_quantizers, 12)
    codes = torch.randint(0, model.config.codebook_size, shape, device=DEVICE)
    plan = [([0, 1, 2], 2), ([0], 3), ([1, 2], 3), ([2, 0], 4), ([1], 4), ([0, 1, 2], 3)]
    decoded = {}
    for kernel in (ra.ring_attention, None):
        stream = MimiStream(model, 4, kv="ring", max_frames=4, ring_attention=kernel)
        slots, done, parts = [1, 3, 0], [0, 0, 0], [[], [], []]
        for group, n in plan:
            index = torch.tensor([slots[g] for g in group], device=DEVICE)
            chunk = torch.stack([codes[g, :, done[g] : done[g] + n] for g in group])
            audio = stream.decode(index, chunk)
            for j, g in enumerate(group):
                parts[g].append(audio[j])
                done[g] += n
        decoded[kernel is not None] = torch.stack([torch.cat(p, dim=-1) for p in parts])
    with torch.inference_mode():
        whole = model.decode(codes).audio_values
    scale = whole.abs().max()
    assert (decoded[True] - whole).abs().max() <= 1e-5 * scale
    assert (decoded[True] - decoded[False]).abs().max() <= 1e-5 * scale
    with pytest.raises(ValueError, match="ring attention reads ring slots"):
        MimiStream(model, 4, kv="gather", ring_attention=ra.ring_attention)


@gpu
def test_gpu_ring_attention_at_mimis_shape() -> None:
    """The real Mimi's shape (8 heads of 64, 250-position window, 252 ring slots) at 64 rows
    of 2 queries, fp32 and bf16, against the gathered SDPA."""
    keys, values, slot_position, _ = _rings(3, 8, 252, 64)
    keys = keys.repeat(22, 1, 1, 1)[:65]
    values = values.repeat(22, 1, 1, 1)[:65]
    slot_position = slot_position.repeat(22, 1)[:65]
    rows = torch.randperm(64, device=DEVICE)
    newest = slot_position[rows].amax(-1, keepdim=True).clamp(min=1)
    q_position = newest + torch.tensor([[-1, 0]], device=DEVICE)  # in the ring already
    for dtype, tol_ in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = randn(64, 8, 2, 64, dtype=dtype)
        k, v = keys.to(dtype), values.to(dtype)
        out = ra.ring_attention(q, k, v, rows, slot_position, q_position, 250, 0.125)
        ref = ra.ring_attention_ref(q, k, v, rows, slot_position, q_position, 250, 0.125)
        assert rel_err(out, ref) < tol_, dtype


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="on a GPU host every test above ran compiled")
def test_every_interpreted_launch_compiles_for_sm90(tmp_path: Path) -> None:
    """The launches the tests above ran in the interpreter, lowered for the H200 (and again
    with PDL on), plus int8_linear's shipped configs at the real decode shapes."""
    if not LAUNCHES:
        pytest.skip("no kernel launched before this test (a -k selection)")
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(LAUNCHES))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(kernel_compile.__file__)), str(path)],
                          env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out[-6000:]
    compiled = int(re.search(r"compiled (\d+) of", out)[1])  # type: ignore[index]
    assert compiled >= 40, out[-2000:]
    print(out[-300:])  # distinct launches: many kernels x configs
