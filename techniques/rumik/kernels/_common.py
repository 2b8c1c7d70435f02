"""Helpers shared by the Rumik decode kernels: device checks, PDL flags, small integer maths.

Nothing here launches a kernel. Triton is imported lazily by the kernel modules themselves, so
importing this module never needs a GPU.
"""

from __future__ import annotations

import torch

# interpreting, l2_copies and graph_ms_per_call serve every family's kernels: orchestrate.api
from orchestrate.api.device import graph_ms_per_call, interpreting, l2_copies

# Dtypes the kernels accept for activations (weights of the GEMV are int8).
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = ["FLOAT_DTYPES", "graph_ms_per_call", "interpreting", "l2_copies"]


def patch_interpreter_scalars() -> None:
    """Make Triton 3.6's interpreter work with numpy >= 2.4 (only under TRITON_INTERPRET=1).

    The interpreter keeps scalars as 1-element arrays and turns them into Python ints with
    int(array), which numpy 2.4 refuses; every `range(lo, hi)` with runtime bounds then fails
    ("only 0-dimensional arrays can be converted to Python scalars", triton-lang/triton#9171,
    fixed upstream by #9172 after 3.6.0). This re-registers the same conversion through
    reshape(-1)[0]; compiled kernels are untouched. Idempotent.
    """
    if not interpreting():
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_fix", False):
        return

    def patched(tensor: object, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def check_device(name: str, *tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, CUDA, or CPU only under the interpreter; returns that device."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"{name}: tensors on different devices: {t.device} and {device}")
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise ValueError(
            f"{name}: tensors must be on a CUDA device (or on the CPU with TRITON_INTERPRET=1), "
            f"got {device}"
        )
    return device


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name}: dtype must be one of {allowed}, got {t.dtype}")


def pdl_enabled(launch_pdl: bool, device: torch.device) -> bool:
    """Programmatic dependent launch where it exists: a Hopper+ GPU. Off under the interpreter
    (CPU tests); requested on an older GPU it is an error, never a silent no-op.

    The kernels call gdc_wait()/gdc_launch_dependents() behind a constexpr that is this value,
    so the interpreter and pre-Hopper GPUs never meet those instructions.
    """
    if not launch_pdl or interpreting() or device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:  # asked for and absent: refuse rather than silently launch without it
        raise ValueError(
            f"launch_pdl=True needs a Hopper GPU (sm_90+); {torch.cuda.get_device_name(device)} "
            f"is sm_{major}{minor}"
        )
    return True


def launch_options(use_pdl: bool, num_warps: int = 4, num_stages: int = 1) -> dict[str, object]:
    """Keyword arguments for kernel[grid](...); launch_pdl is only passed when it is on."""
    opts: dict[str, object] = {"num_warps": num_warps, "num_stages": num_stages}
    if use_pdl:
        opts["launch_pdl"] = True
    return opts


def check_scalar_tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    """A one-element integer tensor on `device` (device-side length / position / counter)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(
            f"{name} must be a one-element int32/int64 tensor on the device (read on the device "
            f"so the launch is CUDA-graph safe), got {type(t).__name__}"
        )
    if t.numel() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be one int32/int64 element, got {tuple(t.shape)} {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    return t


def check_row(name: str, t: torch.Tensor) -> torch.Tensor:
    """One row (batch-1 decode) with a contiguous last dim; returns t."""
    if t.numel() != t.shape[-1]:
        raise ValueError(f"{name} must be one row (batch-1 decode), got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim")
    return t


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_kv_scales(
    name: str, k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    """True for an FP8 cache given with its scales (float32 [B, Hkv, S_max], a contiguous
    last dim, one stride layout for both: checked against the cache), False for none."""
    if k_scale is None and v_scale is None:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError(f"{name}: give both k_scale and v_scale, or neither")
    want = k_cache.shape[:3]
    for which, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.shape != want or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(
                f"{name}: {which} must be float32 {tuple(want)} with a contiguous last dim, "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    if k_scale.stride() != v_scale.stride():
        raise ValueError(f"{name}: k_scale and v_scale must share strides")
    return True


def check_cache_rows(name: str, cache_rows: torch.Tensor, b: int, device: torch.device) -> None:
    """A query -> cache row map: [b] int, contiguous, on the queries' device. Its values are
    not checked (that would sync with the device): the caller keeps them inside the cache."""
    if cache_rows.shape != (b,) or cache_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: cache_rows must be [{b}] int32 or int64")
    if cache_rows.device != device or not cache_rows.is_contiguous():
        raise ValueError(f"{name}: cache_rows must be contiguous, on the queries' device")
