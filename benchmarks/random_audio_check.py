"""Does the real-size random-weight model's audio depend on its seed and prompt?

    python benchmarks/random_audio_check.py --model rumik-oss-1 --device cuda [--frames 25]
        [--out check.json]

Builds the model (seeded random weights), synthesizes two prompts x two seeds with stock at
a fixed length and prints what the worker's same-audio guard finds (running/guards.py),
with each pair's correlation; --out saves them as JSON with the environment (GPU, versions,
git SHA). Before the codecs' codebooks were seeded (api.family.seed_codebooks) every pair was
one waveform: transformers builds them as zero buffers. A check, not a benchmark.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from orchestrate.api.config import LengthPolicy, Prompt, StackSpec, Workload, load_model_spec
from orchestrate.api.registry import build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.running.environment import capture
from orchestrate.running.guards import AudioPrints


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--frames", type=int, default=25)
    ap.add_argument("--out", type=Path, help="write the correlations and the verdict here")
    args = ap.parse_args()
    spec = load_model_spec(args.model, device=args.device)
    family = get_family(spec.family)
    model = family.build_model(spec)
    engine = family.build_engine(model, build_stack(StackSpec(name="stock", family=spec.family),
                                                    DeviceCaps.probe(args.device)))  # fmt: skip
    wl = Workload(
        name="check", prompts=[Prompt(id="a", text="A first one."), Prompt(id="b", text="Two.")],
        seeds=[1, 2], warmups=0, length_policy=LengthPolicy(mode="fixed", frames=args.frames),
        save_audio=0, measure_ttfa=False,
    )  # fmt: skip
    prints, clips = AudioPrints(), {}
    for rnd, (prompt, seed) in enumerate(itertools.product(wl.prompts, wl.seeds)):
        syn = family.synthesize(engine, prompt.text, seed, wl)
        prints.add("stock", prompt.id, prompt.text, seed, rnd, syn.audio, syn.sample_rate)
        clips[f"{prompt.id}/seed {seed}"] = syn.audio.astype(np.float64)
    pairs = []
    for (a, x), (b, y) in itertools.combinations(clips.items(), 2):
        n = min(x.size, y.size)
        pairs.append({"a": a, "b": b, "correlation": float(np.corrcoef(x[:n], y[:n])[0, 1])})
        print(f"{a} vs {b}: correlation {pairs[-1]['correlation']:.4f}")
    same = prints.find("stock")
    print("guard:", same or "no two inputs give the same audio")
    if args.out:
        report = {"environment": capture(args.device, model.config_hash()).model_dump(mode="json"),
                  "model": args.model, "frames": args.frames, "pairs": pairs,
                  "same_audio": same.model_dump() if same else None}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
