"""int8 weights: onnxruntime's dynamic quantisation of the voice's graph.

`onnxruntime.quantization.quantize_dynamic` stores the weights of the chosen modules'
Conv/MatMul/Gather ops as 8-bit integers (per tensor, or per output channel) and quantises
activations on the fly (ConvInteger / MatMulInteger); a quarter of the weight bytes. Whether
that is faster depends on the CPU's integer kernels. Measured on a 2-core AVX2 CPU (joe
voice, one sentence): uint8 weights 0.96-1.10x stock, i.e. within the noise (re-quantising
every activation per call eats what the integer convolutions save; int8_static avoids that);
int8 (signed) weights take a slow path, ~0.5x.

Approximate: every quantised op rounds. Quantising the text encoder or the duration
predictor moves some durations, so the utterance's timing changes too; `modules: [dec]`
keeps stock's timing and changes only the sound (SNR ~20 dB). The quantised graph is
written once per voice and settings under $ORCHESTRATE_CACHE/piper (default
~/.cache/orchestrate/piper) and loaded from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.piper.engine import Engine
from orchestrate.families.piper.model import PiperModel, cache_dir

if TYPE_CHECKING:  # onnx (1.5 s to import) loads when a graph is built, not to list techniques
    import onnx

MODULES = ("enc_p", "dp", "flow", "dec")  # VITS: text encoder, durations, flow, HiFi-GAN
BUILD_VERSION = 1  # bump when the file written for the same params changes


class Int8DynamicParams(TechniqueParams):
    weight_type: Literal["quint8", "qint8"] = Field(
        "quint8", description="uint8 (fast ConvInteger path) or int8 weights."
    )
    modules: tuple[Literal["enc_p", "dp", "flow", "dec"], ...] = Field(
        MODULES, min_length=1, description="Which VITS modules' ops are quantised."
    )
    per_channel: bool = Field(False, description="One scale per output channel.")


class Int8Graph:
    """graph slot: the seedable graph, dynamically quantised (cached on disk)."""

    def __init__(self, params: Int8DynamicParams):
        self.params = params

    def __call__(self, model: PiperModel) -> onnx.ModelProto:
        import onnx
        import onnxruntime
        from onnxruntime.quantization import QuantType, quantize_dynamic

        p = self.params
        key = json.dumps(
            [model.graph_sha256, p.model_dump(mode="json"), onnxruntime.__version__, BUILD_VERSION]
        )
        path = (
            cache_dir()
            / f"{model.onnx_path.stem}-int8-{hashlib.sha256(key.encode()).hexdigest()[:12]}.onnx"
        )
        if not path.exists():
            prefixes = tuple(f"/{m}/" for m in p.modules)
            nodes = [n.name for n in model.seedable.graph.node if n.name.startswith(prefixes)]
            tmp = path.with_suffix(f".{os.getpid()}.partial.onnx")  # concurrent builders
            quiet = logging.getLogger().level
            logging.getLogger().setLevel(logging.ERROR)  # its pre-processing advice, per call
            try:
                quantize_dynamic(
                    model.seedable,
                    tmp,
                    weight_type=QuantType.QUInt8 if p.weight_type == "quint8" else QuantType.QInt8,
                    per_channel=p.per_channel,
                    nodes_to_quantize=nodes,
                )
            finally:
                logging.getLogger().setLevel(quiet)
            tmp.replace(path)
        return onnx.load(str(path))


class Int8Dynamic(Technique):
    name = "int8_dynamic"
    family = "piper"
    exact = False
    slots = ("graph",)
    requires = ("package:onnx",)
    summary = "onnxruntime dynamic int8 quantisation of the voice's graph (uint8 weights)"
    Params = Int8DynamicParams

    def apply(self, engine: Engine) -> None:
        engine.graph = Int8Graph(self.params)  # type: ignore[assignment]
