"""A conditional CUDA WHILE graph around torch-captured bodies (cuda-bindings + NVRTC).

torch 2.11 captures CUDA graphs but exposes no conditional nodes. So each body is captured
by torch (its temporaries then live in torch's private graph pool, which stays correct
across replays), with `keep_graph=True` so the raw cudaGraph_t survives, and a raw outer
graph is assembled with the driver API:

    entry_1 -> WHILE(h_1) { body_1 } -> entry_2 -> WHILE(h_2) { body_2 } -> ...

`entry_i` and the tail of `body_i` run `keep_decoding`, a one-thread kernel that sets the
loop condition h_i from device memory; the bodies are cloned in as child graphs. One
cuGraphLaunch then runs every iteration of every phase with no host involvement.

The condition kernel is compiled once per process with NVRTC (the CUDA toolkit's runtime
compiler ships with torch's CUDA wheels) for the current device's architecture.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

// Continue while step < limit and (when end_id >= 0) the last token is not end_id.
extern "C" __global__ void keep_decoding(
    cudaGraphConditionalHandle handle, const long long* step, const long long* limit,
    const long long* tokens, long long end_id) {
  long long s = *step;
  bool go = s < *limit;
  if (go && end_id >= 0 && s > 0) go = tokens[s - 1] != end_id;
  cudaGraphSetConditional(handle, go ? 1u : 0u);
}
"""

_KERNELS: dict[int, Any] = {}  # device index -> CUfunction


def _ok(result: Any) -> Any:
    """cuda-bindings returns (status, *values); raise on a failed status."""
    status, *values = result
    if int(status) != 0:
        raise RuntimeError(f"CUDA driver/NVRTC call failed: {status!r}")
    return values[0] if len(values) == 1 else tuple(values)


def _compile(device: torch.device) -> Any:
    from cuda.bindings import driver, nvrtc

    major, minor = torch.cuda.get_device_capability(device)
    prog = _ok(nvrtc.nvrtcCreateProgram(_SOURCE.encode(), b"keep_decoding.cu", 0, [], []))
    opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
    (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(status) != 0:
        log = bytearray(_ok(nvrtc.nvrtcGetProgramLogSize(prog)))
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC failed on keep_decoding: {log.decode(errors='replace')}")
    ptx = bytearray(_ok(nvrtc.nvrtcGetPTXSize(prog)))
    _ok(nvrtc.nvrtcGetPTX(prog, ptx))
    image = np.frombuffer(bytes(ptx), dtype=np.uint8)
    module = _ok(driver.cuModuleLoadData(image.ctypes.data))
    return _ok(driver.cuModuleGetFunction(module, b"keep_decoding"))


def keep_decoding_kernel(device: torch.device) -> Any:
    index = torch.device(device).index or 0
    if index not in _KERNELS:
        _KERNELS[index] = _compile(torch.device("cuda", index))
    return _KERNELS[index]


class WhileGraph:
    """An outer graph of sequential WHILE phases; build with `phase`, then `launch`."""

    def __init__(self, device: torch.device):
        from cuda.bindings import driver

        torch.cuda.init()
        self.device = device
        self.kernel = keep_decoding_kernel(device)  # before any capture: loading a module is
        self.graph = _ok(driver.cuGraphCreate(0))  # not allowed while a stream captures
        self.ctx = _ok(driver.cuCtxGetCurrent())
        self.last: Any = None  # the node the next phase depends on
        self.keep: list[Any] = []  # torch graphs whose pools the clones use
        self.exec: Any = None

    def handle(self) -> int:
        """A new loop condition of this graph (0 until an entry kernel sets it)."""
        from cuda.bindings import driver

        return int(_ok(driver.cuGraphConditionalHandleCreate(self.graph, self.ctx, 0, 0)))

    def condition(
        self,
        handle: int,
        step: torch.Tensor,
        limit: torch.Tensor,
        tokens: torch.Tensor,
        end_id: int,
    ) -> None:
        """Launch keep_decoding on the current stream (call it inside a torch capture)."""
        from cuda.bindings import driver

        for t in (step, limit, tokens):
            if t.dtype != torch.long or t.device.type != "cuda":
                raise TypeError("keep_decoding reads int64 CUDA tensors")
        values = np.array(
            [handle, step.data_ptr(), limit.data_ptr(), tokens.data_ptr(), end_id & (2**64 - 1)],
            dtype=np.uint64,
        )
        args = np.array([values.ctypes.data + 8 * i for i in range(5)], dtype=np.uint64)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _ok(driver.cuLaunchKernel(self.kernel, 1, 1, 1, 1, 1, 1, 0, stream, args.ctypes.data, 0))

    def phase(self, handle: int, entry: torch.cuda.CUDAGraph, body: torch.cuda.CUDAGraph) -> None:
        """Append entry -> WHILE(handle) { body }; both captured with keep_graph=True."""
        from cuda.bindings import driver

        deps = [] if self.last is None else [self.last]
        entry_node = _ok(
            driver.cuGraphAddChildGraphNode(
                self.graph, deps, len(deps), driver.CUgraph(entry.raw_cuda_graph())
            )
        )
        params = driver.CUgraphNodeParams()
        params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = driver.CUgraphConditionalHandle(handle)
        params.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = self.ctx
        loop_node = _ok(driver.cuGraphAddNode(self.graph, [entry_node], None, 1, params))
        body_graph = params.conditional.phGraph_out[0]
        _ok(
            driver.cuGraphAddChildGraphNode(
                body_graph, [], 0, driver.CUgraph(body.raw_cuda_graph())
            )
        )
        self.last = loop_node
        self.keep += [entry, body]

    def launch(self) -> None:
        from cuda.bindings import driver

        if self.exec is None:
            self.exec = _ok(driver.cuGraphInstantiate(self.graph, 0))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _ok(driver.cuGraphLaunch(self.exec, stream))

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            if self.exec is not None:
                driver.cuGraphExecDestroy(self.exec)
            driver.cuGraphDestroy(self.graph)
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass
