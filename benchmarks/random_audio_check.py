"""Does the real-size random-weight model's audio depend on its seed and prompt?

    python benchmarks/random_audio_check.py --model rumik-oss-1 --device cuda [--frames 25]

Builds the model (seeded random weights), synthesizes two prompts x two seeds with stock at
a fixed length and prints what the worker's same-audio guard finds (running/guards.py),
with each pair's correlation. Before session 17 every pair was one waveform (the codec's
codebooks were zeros); a check, not a benchmark.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from orchestrate.api.config import LengthPolicy, Prompt, StackSpec, Workload, load_model_spec
from orchestrate.api.registry import build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.running.guards import AudioPrints


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--frames", type=int, default=25)
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
    for (a, x), (b, y) in itertools.combinations(clips.items(), 2):
        n = min(x.size, y.size)
        print(f"{a} vs {b}: correlation {np.corrcoef(x[:n], y[:n])[0, 1]:.4f}")
    print("guard:", prints.find("stock") or "no two inputs give the same audio")


if __name__ == "__main__":
    main()
