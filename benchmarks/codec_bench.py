"""What the serving codec costs on the GPU: streaming Mimi decodes of many rows at once.

    python benchmarks/codec_bench.py --rows 32,128,256,512 --frames 1,4 --out codec.json

The real Mimi decoder (rumik-oss-1's preset, random weights, seeded codebooks) in
MimiStream, as the server's codec runs it: each (rows, frames) decode is captured in a CUDA
graph and its replays timed by CUDA events, variants interleaved per replay:
  fp32        float32, cuDNN's default (TF32 convolutions), what the server runs;
  fp32-ring   float32, TF32 convolutions, the transformer's window in ring slots
              (MimiStream kv="ring": read once a layer, not gathered, appended and written
              back);
  fp32-ring-triton  fp32-ring with each row's ring read in place by
              kernels/ring_attention.py (no gather: the codec_attention "triton" option);
  tf32-ring-triton  fp32-ring-triton with TF32 matmuls too (APPROXIMATE: the transformer's
              linear layers on tensor cores; fp32 leaves them to SIMT kernels);
  fp32-exact  float32 with TF32 off;
  bf16        the decoder in bfloat16 (APPROXIMATE);
  bf16-ring-triton  bf16 with fp32-ring-triton's window and kernel (APPROXIMATE).
Each variant's audio is compared with fp32-exact's (or, without it in --variants, the first
variant's): max |diff| over the reference's peak, recorded beside its time.
`--variants fp32,bf16` times a subset. The first four in one process faulted on an H100 with an
illegal memory access at the first replays, unexplained (benchmarks/h100/serving/
codec-bench-illegal-address.log); each alone ran clean (codec-alone.log): time them one
at a time.
Per variant and shape: the median ms per decode and the codec's throughput, audio seconds
decoded per second (rows * frames * 0.08 s / the median). A server keeping N streams real
time needs at least N audio seconds per second from its codec, beside its decode steps.
`--count-only` (any device, the CPU here): FLOPs of one decode per stream and frame
(torch's FLOP counter) and the state each stream carries, written to --out; no timing.
`--profile ROWS [--profile-kv ring]`: one eager fp32 decode of ROWS rows and 1 frame (the
window gathered, or in ring slots) under torch.profiler: the
CUDA time of the kernels each operator launched itself (self device time, so nothing is
counted twice), by operator, the largest first (where the time goes).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch

from orchestrate.api.device import interleaved_replay_ms
from orchestrate.api.family import seed_codebooks
from orchestrate.families.rumik.engine import tensor_bytes
from orchestrate.families.rumik.mimi_stream import KV_LAYOUTS, MimiStream
from orchestrate.families.rumik.presets import PRESETS
from orchestrate.running.environment import capture
from orchestrate.techniques.rumik.chunk_codec import bfloat16_copy
from orchestrate.techniques.rumik.cuda_graph import warm_and_capture

FRAME_S = 0.08
VARIANTS = (
    "fp32",
    "fp32-ring",
    "fp32-ring-triton",
    "tf32-ring-triton",
    "fp32-exact",
    "bf16",
    "bf16-ring-triton",
)


def build_codec(dtype: torch.dtype, device: str = "cuda"):
    from transformers import MimiConfig, MimiModel

    torch.manual_seed(0)
    with torch.device(device):
        codec = MimiModel(MimiConfig(**PRESETS["rumik-oss-1"].mimi)).eval()
        seed_codebooks(codec)
    if dtype == torch.float32:
        return codec
    assert dtype == torch.bfloat16, dtype
    return bfloat16_copy(codec)  # as the served codec's bf16 precision copies it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="32,128,256,512")
    ap.add_argument("--frames", default="1,4")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which variants, in turn")
    ap.add_argument("--profile", type=int, default=0, help="rows of one profiled decode")
    ap.add_argument("--profile-kv", choices=KV_LAYOUTS, default="gather", help="its window")
    ap.add_argument("--count-only", action="store_true", help="FLOPs and state, no timing")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.count_only:
        args.out.write_text(json.dumps(count(), indent=1))
        return
    env = capture("cuda", "none")
    doc: dict = {"environment": env.model_dump(mode="json"), "frame_s": FRAME_S, "levels": []}
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    fp32 = build_codec(torch.float32)
    bf16 = build_codec(torch.bfloat16) if any(n.startswith("bf16") for n in names) else None
    codecs = {name: bf16 if name.startswith("bf16") else fp32 for name in names}
    tf32 = {name: name != "fp32-exact" for name in VARIANTS}  # convolutions
    tf32_matmul = {name: name.startswith("tf32") for name in VARIANTS}
    ring_kernel = None  # imported (Triton) only where a variant reads the ring in place
    if any(name.endswith("-triton") for name in names):
        from orchestrate.techniques.rumik.kernels.ring_attention import ring_attention

        ring_kernel = ring_attention
    quantizers = fp32.config.num_quantizers
    for frames in (int(f) for f in args.frames.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(rows)
            codes = torch.randint(0, fp32.config.codebook_size, (rows, quantizers, frames),
                                  device="cuda", generator=gen)  # fmt: skip
            index = torch.arange(rows, device="cuda")
            graphs, outs, errors = {}, {}, {}
            for name, codec in codecs.items():
                torch.backends.cudnn.allow_tf32 = tf32[name]  # baked in at capture
                torch.backends.cuda.matmul.allow_tf32 = tf32_matmul[name]
                kv = "ring" if "-ring" in name else "gather"
                kernel = ring_kernel if name.endswith("-triton") else None
                stream = MimiStream(codec, rows, kv, max_frames=frames, ring_attention=kernel)
                try:
                    run = functools.partial(stream.decode, index, codes)
                    graphs[name], outs[name] = warm_and_capture(run)
                except Exception as exc:  # a variant that cannot run is recorded, not timed
                    errors[name] = f"{type(exc).__name__}: {exc}"[:500]
                    print(f"rows {rows} frames {frames}: {name} failed: {errors[name]}")
            times = interleaved_replay_ms(graphs, args.replays)
            # fp32-exact is the reference where it ran; else the first variant that did
            ref_name = "fp32-exact" if "fp32-exact" in outs else next(iter(outs))
            ref = outs[ref_name].float()
            level = {"rows": rows, "frames": frames, "replays": args.replays, "variants": {}}
            level["errors"] = errors
            if not outs:
                doc["levels"].append(level)
                continue
            for name, t in times.items():
                ms = statistics.median(t)
                # None: the reference itself (a diff of 0 would say nothing)
                diff = None
                if name != ref_name:
                    diff = float((outs[name].float() - ref).abs().max() / ref.abs().max())
                level["variants"][name] = {
                    "median_ms_per_decode": ms,
                    "audio_s_per_s": rows * frames * FRAME_S / (ms / 1000),
                    "max_abs_diff_over_peak": diff,
                    "diff_reference": ref_name,
                }
                shown = "reference" if diff is None else f"{diff:.1e} vs {ref_name}"
                print(
                    f"rows {rows:4d} frames {frames}: {name:10s} {ms:8.3f} ms"
                    f" {rows * frames * FRAME_S / (ms / 1000):9.0f} audio s/s, diff {shown}",
                    flush=True,
                )
            doc["levels"].append(level)
            args.out.write_text(json.dumps(doc, indent=1))
            del graphs, outs
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.profile:
        doc["profile"] = profile(fp32, args.profile, args.profile_kv)
        args.out.write_text(json.dumps(doc, indent=1))


def count(rows: int = 4) -> dict:
    """FLOPs of one 1-frame decode per stream, by module, and the bytes of state a stream
    carries (convolution tails; the transformer's windowed keys and values), float32."""
    from torch.utils.flop_counter import FlopCounterMode

    from orchestrate.running.environment import git_state

    codec = build_codec(torch.float32, "cpu")
    stream = MimiStream(codec, rows)
    shape = (rows, codec.config.num_quantizers, 1)
    codes = torch.randint(0, codec.config.codebook_size, shape)
    with FlopCounterMode(display=False) as counter:
        stream.decode(torch.arange(rows), codes)
    by_module = {name: sum(ops.values()) / rows for name, ops in counter.get_flop_counts().items()}
    sha, dirty = git_state()
    doc = {
        "preset": "rumik-oss-1",
        "git_sha": sha,
        "dirty": dirty,
        "torch": torch.__version__,
        "frame_s": FRAME_S,
        "flops_per_stream_frame": counter.get_total_flops() / rows,
        "flops_per_stream_frame_by_module": by_module,
        "conv_state_bytes_per_stream": tensor_bytes(*(t[0] for t in stream.state.values())),
        "kv_state_bytes_per_stream": tensor_bytes(*(t[0] for t in stream.keys + stream.values)),
    }
    print(json.dumps({k: v for k, v in doc.items() if "by_module" not in k}, indent=1))
    return doc


def profile(codec, rows: int, kv: str, top: int = 20) -> dict:
    """CUDA kernel time of one eager decode (after one warm-up), by operator."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    stream = MimiStream(codec, rows, kv=kv)
    shape = (rows, codec.config.num_quantizers, 1)
    codes = torch.randint(0, codec.config.codebook_size, shape, device="cuda")
    index = torch.arange(rows, device="cuda")
    stream.decode(index, codes)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stream.decode(index, codes)
        torch.cuda.synchronize()
    kernels = [
        (e.key, e.self_device_time_total / 1000, e.count)
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0
    ]
    kernels.sort(key=lambda k: -k[1])
    total = sum(ms for _, ms, _ in kernels)
    for name, ms, n in kernels[:top]:
        print(f"{ms:8.3f} ms {n:5d}x  {name[:90]}", flush=True)
    print(f"profile: {total:.3f} ms of CUDA kernels in one decode of {rows} rows", flush=True)
    if not kernels:
        print("profile: no operator reported device time (this profiler's event layout)")
    return {
        "rows": rows,
        "frames": 1,
        "kv": kv,
        "kernel_ms_total": total,
        "top": [{"operator": k, "ms": ms, "calls": n} for k, ms, n in kernels[:top]],
    }


if __name__ == "__main__":
    main()
