"""Rewrites of a Piper voice's ONNX graph (VITS: text encoder, stochastic duration predictor,
flow, HiFi-GAN decoder), done once per graph with the `onnx` package.

`seedable`: Piper's noise comes from two RandomNormalLike ops inside the graph (the duration
predictor's and the flow's prior sample). onnxruntime seeds each from a per-session
generator that keeps its state across calls, so the same text gives different audio on
every call, and which audio depends on how many calls the session served before (warm-ups,
other prompts). Each op is replaced by a graph input of standard-normal noise the host
draws from the utterance's seed: `Slice(Tile(noise, ceil(shape(x) / shape(noise))),
0, shape(x))`, i.e. the host's noise cut (or, only past the end of what the host drew,
repeated) to the shape the op would have drawn. The distribution is the op's (standard
normal); the stream is numpy's. It also exposes the rounded durations (w_ceil, frames per
phoneme id: what `piper.patch_voice_with_alignment` exposes) as the output `durations`.

`teacher_forced`: the durations become an input (`forced_durations`), so a stack's audio
can be compared with stock's sample by sample on stock's timing (fidelity.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # onnx (1.5 s to import) loads when a graph is built, not to list techniques
    import onnx

NOISE_OP = "RandomNormalLike"
DURATIONS = "durations"
FORCED = "forced_durations"


@dataclass(frozen=True)
class NoiseInput:
    """One replaced random op: the graph input's name and its channel count (axis 1)."""

    name: str
    op: str  # the replaced node's name
    channels: int
    per_phoneme: bool  # its last axis is the phoneme ids' (else: decoder frames)


def _ceil_output(model: onnx.ModelProto) -> str:
    outs = [o for n in model.graph.node if n.op_type == "Ceil" for o in n.output]
    if len(outs) != 1:
        raise ValueError(f"expected one Ceil (w_ceil) in a Piper graph, found {len(outs)}")
    return outs[0]


def random_ops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == NOISE_OP]


def probe_noise(model: onnx.ModelProto, ids: list[int]) -> list[NoiseInput]:
    """Shapes of the random ops' draws, read off one run of the original graph on `ids`."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    ops = random_ops(probe)
    del probe.graph.output[:]
    for node in ops:
        probe.graph.output.append(helper.make_empty_tensor_value_info(node.output[0]))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {
        "input": np.array([ids], dtype=np.int64),
        "input_lengths": np.array([len(ids)], dtype=np.int64),
        "scales": np.array([0.667, 1.0, 0.8], dtype=np.float32),
    }
    if "sid" in {i.name for i in session.get_inputs()}:
        feeds["sid"] = np.array([0], dtype=np.int64)
    drawn = session.run(None, feeds)
    out = []
    for k, (node, noise) in enumerate(zip(ops, drawn, strict=True)):
        if noise.ndim != 3:
            raise ValueError(
                f"{node.name}: expected a [batch, channels, time] draw, got {noise.shape}"
            )
        out.append(
            NoiseInput(f"noise_{k}", node.name, int(noise.shape[1]), noise.shape[2] == len(ids))
        )
    return out


def seedable(model: onnx.ModelProto, noises: list[NoiseInput]) -> onnx.ModelProto:
    """A copy of `model` whose random ops read host noise, with `durations` as an output."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    by_name = {n.op: n for n in noises}
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        if node.op_type != NOISE_OP:
            nodes.append(node)
            continue
        spec = by_name[node.name]
        like, target, p = node.input[0], node.output[0], f"{spec.name}/"
        g.input.append(
            helper.make_tensor_value_info(
                spec.name, TensorProto.FLOAT, ["batch", spec.channels, f"{spec.name}_t"]
            )
        )
        nodes += [
            helper.make_node(op, ins, [out], name=p + out.removeprefix(p))
            for op, ins, out in (
                ("Shape", [like], p + "want"),
                ("Shape", [spec.name], p + "have"),
                ("Add", [p + "want", p + "have"], p + "sum"),
                ("Sub", [p + "sum", p + "one"], p + "up"),
                ("Div", [p + "up", p + "have"], p + "repeats"),
                ("Tile", [spec.name, p + "repeats"], p + "tiled"),
                ("Slice", [p + "tiled", p + "zeros", p + "want"], target),
            )
        ]
        g.initializer.extend(
            [
                numpy_helper.from_array(np.ones(3, dtype=np.int64), p + "one"),
                numpy_helper.from_array(np.zeros(3, dtype=np.int64), p + "zeros"),
            ]
        )
    del g.node[:]
    g.node.extend(nodes)
    g.node.append(helper.make_node("Identity", [_ceil_output(out)], [DURATIONS], name=DURATIONS))
    g.output.append(helper.make_tensor_value_info(DURATIONS, TensorProto.FLOAT, None))
    return out


def teacher_forced(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a `seedable` graph that takes its durations from the input `forced_durations`
    ([batch, 1, phoneme ids], frames) instead of the duration predictor; `durations` still
    reports what the predictor said."""
    import onnx
    from onnx import TensorProto, helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    ceil = _ceil_output(out)
    for node in out.graph.node:
        if node.op_type == "Identity" and list(node.output) == [DURATIONS]:
            continue
        for i, name in enumerate(node.input):
            if name == ceil:
                node.input[i] = FORCED
    out.graph.input.append(
        helper.make_tensor_value_info(FORCED, TensorProto.FLOAT, ["batch", 1, "phonemes"])
    )
    return out
