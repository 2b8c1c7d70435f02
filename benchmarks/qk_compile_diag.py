"""Why test_qk_norm_rope_op_inside_torch_compile failed on the H200 (its output:
benchmarks/h200/issue14-qk-compile-diag.log): for each of the three op forms, compiled
against eager, with and without torch._dynamo.reset() between forms. Prints shape, stride,
torch.equal and the max difference per output tensor."""

import functools

import torch

from orchestrate.techniques.omnivoice.kernels import qk_norm_rope as qkr

torch.manual_seed(0)
b, s, hq, hkv, d = 2, 37, 16, 8, 128
qkv = torch.randn(b, s, (hq + 2 * hkv) * d + 3, device="cuda", dtype=torch.bfloat16)
qkv = qkv[..., : (hq + 2 * hkv) * d]
qw, kw = (torch.randn(d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ang = torch.rand(1, s, d // 2, device="cuda") * 6.0
cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.bfloat16).contiguous()
sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.bfloat16).contiguous()
case = (qkv, qw, kw, cos, sin)
forms = (
    ("qk", qkr.qk_norm_rope_op(), qkr.qk_norm_rope),
    ("qkv tokens-major", qkr.qkv_norm_rope_op(), qkr.qkv_norm_rope),
    (
        "qkv heads-major",
        qkr.qkv_norm_rope_op(False),
        functools.partial(qkr.qkv_norm_rope, tokens_major=False),
    ),
)
for reset in (False, True):
    torch._dynamo.reset()
    for name, op, launch in forms:
        if reset:
            torch._dynamo.reset()
        compiled = torch.compile(lambda *a, op=op: op(*a, 1e-6, 16, 8), dynamic=False)
        got, eager = compiled(*case), launch(*case, 1e-6, 16, 8)
        for i, (g, e) in enumerate(zip(got, eager, strict=False)):  # lengths may differ
            same = g.shape == e.shape and torch.equal(g, e)
            diff = float((g.float() - e.float()).abs().max()) if g.shape == e.shape else -1.0
            print(
                f"reset={reset} {name:17s} out{i} compiled {tuple(g.shape)} {g.stride()} "
                f"eager {tuple(e.shape)} {e.stride()} equal={same} max_diff={diff:.3g}"
            )
