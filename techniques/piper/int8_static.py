"""int8 weights and activations: onnxruntime's static quantisation of the voice's graph.

`onnxruntime.quantization.quantize_static` calibrates each activation's range on a few fixed
sentences (CALIBRATION below, never a workload's prompts, so nothing is tuned on what is
measured), then stores int8 weights (one scale per output channel) and uint8 activations
with fixed scales. onnxruntime runs the chosen modules' convolutions and matmuls as
QLinearConv / QLinearMatMul: integer kernels with no per-call range computation, unlike
int8_dynamic, whose ConvInteger re-quantises every activation on the fly and is not faster
here. Measured on a 2-core AVX2 CPU (joe voice, one sentence): ~1.2x with the decoder
alone, ~1.3x with text encoder + flow, ~1.5x with all three (the default). The integer
kernels are the CPU's: on a 2-core AMD EPYC without VNNI an exploration measured the
default at 1.15x [1.10, 1.21] paired on dev prompts and 1.11x [1.03, 1.21] on fresh seeds.

Weights are quantised to 7 bits (`reduce_range`, on by default): on an x86 CPU without VNNI
(AVX2 or AVX-512F only) onnxruntime multiplies uint8 by int8 with VPMADDUBSW, whose int16
pair sums saturate with full 8-bit weights. Measured on a 2-core AMD EPYC (AVX2, no VNNI):
with 8-bit weights the default modules' spectral KL against stock was 1.38, four times
another seed's 0.34 (tests/test_piper.py); with 7-bit weights it is within twice that. The
integer products are then exact on hosts with VNNI and without it alike.

Approximate: every quantised op rounds, and fixed activation ranges clip what calibration
did not see. Quantising the text encoder (`enc_p`) moves some durations (the duration
predictor reads its output); `modules: [dec]` keeps stock's timing and changes only the
sound (SNR ~17 dB against stock; spectral KL 0.36, about what another seed of stock moves:
0.37). Quantising the decoder is what listeners (DNSMOS) hear: -0.5 MOS with `dec`, -0.02
with `[enc_p, flow]`; Whisper's WER does not move either way.
The quantised graph is written once per voice and settings under $ORCHESTRATE_CACHE/piper
(default ~/.cache/orchestrate/piper) and loaded from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.piper.engine import Engine, stock_engine
from orchestrate.families.piper.model import PiperModel, cache_dir

if TYPE_CHECKING:  # onnx (1.5 s to import) loads when a graph is built, not to list techniques
    import onnx

BUILD_VERSION = 2  # bump when the file written for the same params changes
CALIBRATION = (
    "A gentle breeze moved through the tall grass near the old stone bridge.",
    "Could you tell me how far it is to the nearest train station?",
    "Seven hundred and twelve people signed the petition on Tuesday!",
    "Quiet, please. The concert is about to begin.",
)
OPS = ("Conv", "ConvTranspose", "MatMul")


class Int8StaticParams(TechniqueParams):
    modules: tuple[Literal["enc_p", "dp", "flow", "dec"], ...] = Field(
        ("enc_p", "flow", "dec"),
        min_length=1,
        description="VITS modules quantised: text encoder, duration predictor, flow, decoder.",
    )
    format: Literal["qdq", "qoperator"] = Field(
        "qdq",
        description="QuantizeLinear/DequantizeLinear pairs (fused by onnxruntime) or "
        "QLinear ops written directly.",
    )
    reduce_range: bool = Field(
        True,
        description="7-bit weights: no int16 saturation in onnxruntime's uint8 x int8 "
        "kernels on x86 CPUs without VNNI.",
    )


class _Calibration:
    """onnxruntime's CalibrationDataReader protocol over stock's inputs for CALIBRATION."""

    def __init__(self, model: PiperModel):
        engine = stock_engine(model)  # for its host noise and scales only (no session)
        self.feeds = []
        for i, text in enumerate(CALIBRATION):
            for s in engine.draw(model.sentences(text), seed=i):
                feed = {
                    "input": np.array([s.ids], dtype=np.int64),
                    "input_lengths": np.array([len(s.ids)], dtype=np.int64),
                    **engine.feeds(voice=next(iter(model.voice.config.speaker_id_map), "")),
                }
                feed.update({n.name: s.noise[k][None] for k, n in enumerate(model.noises)})
                self.feeds.append(feed)
        self.left = iter(self.feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.left, None)

    def rewind(self) -> None:
        self.left = iter(self.feeds)


class Int8StaticGraph:
    """graph slot: the seedable graph, statically quantised (cached on disk)."""

    def __init__(self, params: Int8StaticParams):
        self.params = params

    def __call__(self, model: PiperModel) -> onnx.ModelProto:
        import onnx
        import onnxruntime
        from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

        p = self.params
        key = json.dumps(
            [model.graph_sha256, p.model_dump(mode="json"), CALIBRATION, onnxruntime.__version__,
             BUILD_VERSION]
        )  # fmt: skip
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        path = cache_dir() / f"{model.onnx_path.stem}-int8s-{digest}.onnx"
        if not path.exists():
            source = cache_dir() / f"{model.onnx_path.stem}-seedable-{model.graph_sha256[:12]}.onnx"
            if not source.exists():  # quantize_static wants a file, not a proto
                partial = source.with_suffix(f".{os.getpid()}.partial.onnx")
                onnx.save(model.seedable, partial)
                partial.replace(source)
            prefixes = tuple(f"/{m}/" for m in p.modules)
            nodes = [n.name for n in model.seedable.graph.node if n.name.startswith(prefixes)]
            tmp = path.with_suffix(f".{os.getpid()}.partial.onnx")  # concurrent builders
            quiet = logging.getLogger().level
            logging.getLogger().setLevel(logging.ERROR)  # its pre-processing advice
            try:
                quantize_static(
                    source,
                    tmp,
                    _Calibration(model),
                    quant_format=QuantFormat.QDQ if p.format == "qdq" else QuantFormat.QOperator,
                    per_channel=True,
                    weight_type=QuantType.QInt8,
                    activation_type=QuantType.QUInt8,
                    reduce_range=p.reduce_range,
                    nodes_to_quantize=nodes,
                    op_types_to_quantize=list(OPS),
                )
            finally:
                logging.getLogger().setLevel(quiet)
            tmp.replace(path)
        return onnx.load(str(path))


class Int8Static(Technique):
    name = "int8_static"
    family = "piper"
    exact = False
    slots = ("graph",)
    requires = ("package:onnx",)
    summary = "onnxruntime static int8 quantisation (calibrated; QLinearConv), ~1.5x on a CPU"
    Params = Int8StaticParams

    def apply(self, engine: Engine) -> None:
        engine.graph = Int8StaticGraph(self.params)  # type: ignore[assignment]
