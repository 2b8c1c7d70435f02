"""Compile Triton launches for the H200 (sm_90) on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which executes their Python; the
compiler also types and lowers them, and refuses code the interpreter accepts: an `_fma`
that returned inside a constexpr-if passed every CPU test (the interpreter took one branch)
and failed every reduce_each config on the H200 (the compiler builds both). Triton's wheel
ships ptxas, so lowering to a cubin runs here.

test_kernels.py records each interpreted launch (`describe`) and hands the list to this file's
main, run in a fresh process (the interpreter is chosen when a kernel is decorated):

    python tests/kernel_compile.py LAUNCHES.json

It compiles every recorded launch as recorded and once more with PDL on (the interpreter never
takes that branch), then int8_linear at Rumik's two decode shapes with every shipped or
candidate GemvConfig, with and without preload, and prints one line per failure.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch

TARGET = ("cuda", 90, 32)  # the H200: sm_90, 32-thread warps
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}  # fmt: skip
_OPTIONS = ("num_warps", "num_stages")


def describe(fn: Any, args: tuple, kwargs: dict) -> dict:
    """One launch of a Triton function (interpreted or compiled) as JSON: the kernel, each
    argument's Triton type or constexpr value, and the compile options."""
    py = getattr(fn, "fn", fn)
    sig = inspect.signature(py)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    types: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name, param in sig.parameters.items():
        value = bound.arguments[name]
        if "constexpr" in str(param.annotation) or value is None:
            # a tl.dtype (a kernel's output dtype) travels as its name
            constexprs[name] = {"tl.dtype": str(value)} if _is_tl_dtype(value) else value
        elif isinstance(value, torch.Tensor):
            types[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif _is_tensor_descriptor(value):
            block = ", ".join(str(b) for b in value.block_shape)
            types[name] = f"tensordesc<{_TYPES[value.base.dtype]}[{block}]>"
        elif isinstance(value, float):
            types[name] = "fp32"
        else:
            raise TypeError(f"{py.__name__}: argument {name} of type {type(value).__name__}")
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    return {"module": py.__module__, "name": py.__name__, "params": list(sig.parameters),
            "types": types, "constexprs": constexprs, "options": options}  # fmt: skip


def _is_tensor_descriptor(value: object) -> bool:
    from triton.tools.tensor_descriptor import TensorDescriptor

    return isinstance(value, TensorDescriptor)


def _is_tl_dtype(value: object) -> bool:
    import triton.language as tl

    return isinstance(value, tl.dtype)


def compile_launch(launch: dict) -> None:
    """Lower one described launch to a cubin for TARGET; raises what the compiler raises."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    consts = {k: tl.dtype(v["tl.dtype"]) if isinstance(v, dict) else v
              for k, v in launch["constexprs"].items()}  # fmt: skip
    signature = {p: "constexpr" if p in consts else launch["types"][p] for p in launch["params"]}
    src = ASTSource(fn, signature, consts)
    triton.compile(src, target=GPUTarget(*TARGET), options=launch["options"])


def _variants(launch: dict) -> list[dict]:
    out = [launch]
    if launch["constexprs"].get("USE_PDL") is False:
        out.append({**launch, "constexprs": {**launch["constexprs"], "USE_PDL": True}})
    return out


def shipped_gemv_launches() -> list[dict]:
    """int8_linear's launches at Rumik OSS 1's decode shapes for every config the repo ships
    or sweeps, with PDL, captured from the launcher itself (its EVEN/TAIL/preload choices)."""
    from dataclasses import replace

    from orchestrate.techniques.rumik.kernels import int8_gemv as g

    launches: list[dict] = []

    def capture(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(describe(self, args, kwargs))

    from triton.runtime.jit import JITFunction

    original = JITFunction.run
    saved = g.check_device, g.pdl_enabled
    JITFunction.run = capture  # type: ignore[method-assign]
    g.check_device = lambda name, *t: t[0].device  # CPU tensors stand in for the GPU's
    g.pdl_enabled = lambda launch_pdl, device: launch_pdl
    try:
        configs = {*g.GEMV_CONFIGS, *g.H200_CONFIGS.values()}
        configs |= {c for table in g.GEMV_TABLES.values() for c in table.values()}
        configs |= {replace(c, preload=True) for c in configs if not c.prefetch}
        configs |= {c for shape in g.TMA_CONFIGS.values() for c in shape}
        for n, k in ((25088, 2048), (2048, 13056)):
            q = torch.zeros(n, k, dtype=torch.int8)
            scale = torch.ones(n, dtype=torch.bfloat16)
            x = torch.zeros(1, k, dtype=torch.bfloat16)
            for cfg in sorted(configs, key=repr):
                try:
                    g.int8_linear(x, q, scale, config=cfg, launch_pdl=True)
                except ValueError:  # the launcher refuses this config for this shape
                    continue
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
        g.check_device, g.pdl_enabled = saved
    return launches


def main(path: str) -> int:
    recorded = json.loads(Path(path).read_text())
    launches = [v for launch in recorded for v in _variants(launch)] + shipped_gemv_launches()
    unique = {json.dumps(launch, sort_keys=True): launch for launch in launches}
    failures = 0
    for launch in unique.values():
        try:
            compile_launch(launch)
        except Exception as e:  # report every failing launch, not only the first
            failures += 1
            root: BaseException = e
            while root.__cause__ is not None:  # Triton wraps the reason once per call level
                root = root.__cause__
            detail = f"{type(root).__name__}: {str(root).strip().splitlines()[-1:]}"
            print(f"FAIL {launch['name']} {launch['constexprs']}: {detail}")
    print(f"compiled {len(unique) - failures} of {len(unique)} launches for sm_90")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
