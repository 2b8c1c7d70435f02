"""Next-token fidelity against stock, teacher-forced on one token sequence.

Every engine is fed the same prompt and the same generated tokens; at each step its head's
logits are placed in one canonical space (audio units, then end-of-audio) so heads of any
width compare. Exact techniques must stay within tolerance; approximate ones report how
far they move the distribution.

Teacher forcing never samples, so a stack whose sampler or loop is not stock's gets tests of
its own: its sampler's draws against stock's sampler's on the same head outputs (total
variation), and its loop's tokens against stock's loop over the same parts (same seed).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from orchestrate.api.config import SamplingConfig
from orchestrate.api.records import FidelityRecord
from orchestrate.families.rumik.engine import (
    SLOTS,
    Engine,
    HeadLogits,
    Loop,
    Sampler,
    host_loop,
    stock_engine,
    stock_sampler,
)
from orchestrate.families.rumik.model import RumikModel

# fp32: max |logit diff| over the std of stock's logits; only summation order differs.
FP32_TOLERANCE = 1e-3
# bf16/fp16 round every matmul and the residual stream, and a reordered sum rounds
# differently, so no fixed bar is honest. Both stock and the stack are measured against an
# fp32 upcast of the same weights; an exact stack must stay within this factor of stock's
# own rounding error (its "noise floor").
NOISE_FACTOR = 2.0
# Teacher forcing runs the model's step (decoder, projections, attention, head, launch
# settings), never the sampler or the generation loop; those are covered only where their
# own tests ran (`judge_slots`), otherwise a stack's exact claim there is the plugin's word,
# and each record says so (`not_covered`).
COVERS = tuple(s for s in SLOTS if s not in ("sampler", "loop"))
# Sampler test: head outputs (teacher-forced steps) it draws on, draws per sampler on each,
# and the chance that a sampler with exactly stock's distribution still lands over the bound
# (see tv_bound). 2,000 draws x 4 rows x 2 samplers is ~0.8 s for the tiny model on 2 cores.
SAMPLER_ROWS = 4
SAMPLER_DRAWS = 2000
FALSE_ALARM = 1e-6
# force_end makes stock's draw certain (end-of-audio): a point mass has null TV exactly 0,
# so a few draws show a sampler that ignores it.
FORCED_DRAWS = 16


def coverage(engine: Engine, tested: tuple[str, ...] = ()) -> dict[str, object]:
    """What a comparison of `engine` ran (teacher forcing plus the `tested` slots), and the
    slots it filled that it did not run."""
    covers = [*COVERS, *tested]
    missed = {slot: t for slot, t in engine.filled.items() if slot not in covers}
    return {"covers": covers, "not_covered": missed}


def canonical(engine: Engine, out: HeadLogits) -> torch.Tensor:
    vocab = engine.model.vocab
    n = vocab.num_units + 1
    dst = torch.full((n,), float("-inf"), device=out.logits.device)
    row = out.logits[0]
    if out.column_ids is None:  # full vocabulary: pick the candidate columns
        return torch.cat(
            [
                row[vocab.first_unit_id : vocab.last_unit_id + 1],
                row[vocab.end_id : vocab.end_id + 1],
            ]
        )
    pos = torch.where(out.column_ids == vocab.end_id, n - 1, out.column_ids - vocab.first_unit_id)
    dst[pos] = row
    return dst


@torch.inference_mode()
def teacher_forced(
    engine: Engine,
    prompt_ids: list[int],
    tokens: list[int],
    heads: list[HeadLogits] | None = None,
) -> torch.Tensor:
    """[len(tokens), units + 1] canonical logits, step i predicting tokens[i]. With `heads`,
    each step's head output is appended there too (copied: a head may reuse its buffers)."""
    device = engine.model.device
    decoder = engine.new_decoder(len(prompt_ids) + len(tokens) + 1)
    hidden = decoder.prefill(torch.tensor([prompt_ids], device=device))
    rows = []
    for step, tok in enumerate(tokens):
        out = engine.head(hidden, step)
        rows.append(canonical(engine, out))
        if heads is not None:
            ids = None if out.column_ids is None else out.column_ids.clone()
            heads.append(dataclasses.replace(out, logits=out.logits.clone(), column_ids=ids))
        if step + 1 < len(tokens):
            hidden = decoder.step(torch.tensor([[tok]], device=device))
    return torch.stack(rows).float()


def compare(
    stock: torch.Tensor, other: torch.Tensor, temperature: float, top_k: int, dtype: torch.dtype
) -> FidelityRecord:
    """Stats of `other` against `stock`; in fp32, within tolerance by a fixed bar."""
    finite = torch.isfinite(other)
    diff = (other - stock).abs().where(finite, torch.zeros_like(stock))
    scale = stock[torch.isfinite(stock)].std().clamp_min(1e-6)
    log_p = torch.log_softmax(other / temperature, -1)  # candidate's distribution
    log_q = torch.log_softmax(stock / temperature, -1)
    kl = (log_p.exp() * (log_p - log_q)).where(finite, torch.zeros_like(log_p)).sum(-1)
    top1 = (other.argmax(-1) == stock.argmax(-1)).float().mean()
    # A restricted head (codebook_head) puts -inf outside its columns; stock renormalised
    # over those columns separates what else changed from the restriction itself.
    stock_on = stock.masked_fill(~finite, float("-inf"))
    log_q_on = torch.log_softmax(stock_on / temperature, -1)
    support_kl = (log_p.exp() * (log_p - log_q_on)).where(finite, torch.zeros_like(log_p)).sum(-1)
    support_top1 = (other.argmax(-1) == stock_on.argmax(-1)).float().mean()
    a, b = other.topk(top_k, -1).indices, stock.topk(top_k, -1).indices
    inter = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1).float()
    jaccard = (inter / (2 * top_k - inter)).mean()
    return FidelityRecord(
        steps=stock.shape[0],
        max_abs_logit_diff=float(diff.max()),
        mean_kl=float(kl.mean().clamp_min(0)),
        max_kl=float(kl.max().clamp_min(0)),
        top1_agreement=float(top1),
        topk_agreement=float(jaccard),
        support_kl=float(support_kl.mean().clamp_min(0)),
        support_top1=float(support_top1),
        within_tolerance=bool(float(diff.max() / scale) <= FP32_TOLERANCE and bool(finite.all())),
        tolerance=FP32_TOLERANCE,
    )


def judge_half(
    rec: FidelityRecord, vs_fp32: FidelityRecord, floor: FidelityRecord
) -> FidelityRecord:
    """Half precision: within tolerance when the stack is no further from the fp32 upcast
    than NOISE_FACTOR x stock's own distance (max logit diff and mean KL)."""
    ok = (
        vs_fp32.max_abs_logit_diff <= NOISE_FACTOR * floor.max_abs_logit_diff
        and vs_fp32.mean_kl <= NOISE_FACTOR * floor.mean_kl
    )
    return rec.model_copy(
        update={
            "within_tolerance": bool(ok and math.isfinite(rec.max_abs_logit_diff)),
            "tolerance": NOISE_FACTOR,
            "noise_floor_max_abs": floor.max_abs_logit_diff,
            "noise_floor_kl": floor.mean_kl,
        }
    )


def upcast(model: RumikModel) -> RumikModel:
    """The same (rounded) weights in fp32: the reference half-precision error is measured to."""
    return dataclasses.replace(
        model,
        lm=copy.deepcopy(model.lm).float(),
        stop_head=copy.deepcopy(model.stop_head).float(),
    )


def tv_bound(draws: int, support: int, rows: int) -> float:
    """The total variation that two samples of `draws` tokens each, from one distribution
    over at most `support` tokens, exceed on any of `rows` rows with probability < FALSE_ALARM.

    Derived from sampling error alone, so no tuning: per token j, E|p^_j - q^_j| <=
    sqrt(2 p_j (1 - p_j) / n), and by Cauchy-Schwarz the worst case (uniform) gives
    E[TV] <= sqrt((support - 1) / (2n)). One draw moves TV by at most 1/n, so McDiarmid over
    the 2n draws gives P(TV >= E[TV] + t) <= exp(-n t^2); a union over the rows sets t.
    """
    spread = math.sqrt(max(support - 1, 0) / (2 * draws))
    return spread + math.sqrt(math.log(rows / FALSE_ALARM) / draws)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    """TV distance between the empirical distributions of two 1-D token-id samples."""
    ids, inv = torch.unique(torch.cat([a, b]), return_inverse=True)
    pa = torch.bincount(inv[: len(a)], minlength=len(ids)) / len(a)
    pb = torch.bincount(inv[len(a) :], minlength=len(ids)) / len(b)
    return float((pa - pb).abs().sum() / 2)


def draw(
    sampler: Sampler,
    head: HeadLogits,
    n: int,
    seed: int,
    sampling: SamplingConfig,
    allow_end: bool,
    force_end: bool,
) -> torch.Tensor:
    """`n` token ids from `sampler` on one head output, its random stream seeded `seed`."""
    gen = torch.Generator(device=head.logits.device).manual_seed(seed)
    if reset := getattr(sampler, "reset", None):  # device RNG state, started as loops do
        reset(seed)
    ids = [
        sampler(head, allow_end=allow_end, force_end=force_end, sampling=sampling, generator=gen)
        for _ in range(n)
    ]
    return torch.cat([i.view(1) for i in ids]).cpu()


def sampler_cases(heads: list[HeadLogits]) -> list[tuple[HeadLogits, bool, bool, int]]:
    """(head output, allow_end, force_end, draws): SAMPLER_ROWS head outputs spread over the
    steps, end-of-audio masked and allowed in turn, and one with end-of-audio forced."""
    picks = sorted(
        {round(i * (len(heads) - 1) / max(SAMPLER_ROWS - 1, 1)) for i in range(SAMPLER_ROWS)}
    )
    cases = [(heads[p], i % 2 == 1, False, SAMPLER_DRAWS) for i, p in enumerate(picks)]
    return [*cases, (heads[picks[0]], False, True, FORCED_DRAWS)]


@torch.inference_mode()
def sampler_check(
    sampler: Sampler, heads: list[HeadLogits], sampling: SamplingConfig, seed: int
) -> tuple[float, float]:
    """(max TV, bound): `sampler` against stock's on a few of the engine's own head outputs
    (the columns and layout it meets in this stack), end-of-audio masked, allowed, forced."""
    cases = sampler_cases(heads)
    tv = 0.0
    for head, allow_end, force_end, n in cases:
        # Other seeds for the two: the bound is for independent samples.
        ref = draw(stock_sampler, head, n, seed, sampling, allow_end, force_end)
        got = draw(sampler, head, n, seed + 1, sampling, allow_end, force_end)
        tv = max(tv, total_variation(ref, got))
    support = min(sampling.top_k, heads[0].logits.shape[-1])  # stock draws from its top k
    return tv, tv_bound(SAMPLER_DRAWS, support, len(cases))


@torch.inference_mode()
def loop_check(
    engine: Engine, prompt_ids: list[int], frames: int, sampling: SamplingConfig, seed: int
) -> dict[str, object]:
    """The engine's loop against stock's loop (host_loop) over the same decoder, head and
    sampler, from one seed: only the loop differs, so an exact loop gives the same tokens."""

    def tokens(loop: Loop) -> list[int]:
        gen = torch.Generator(device=engine.model.device).manual_seed(seed)
        return loop(engine, prompt_ids, frames, sampling, gen).tokens

    ref, got = tokens(host_loop), tokens(engine.loop)
    # slices, so a loop that stops early (or runs on) diverges where the shorter one ends
    first = next(
        (i for i in range(max(len(ref), len(got))) if ref[i : i + 1] != got[i : i + 1]), None
    )
    if first is None:
        note = f"{len(ref)} tokens identical to host_loop over this engine's parts, same seed"
    else:
        # Identity needs both loops on one random stream; a loop on another stream differs
        # too, and no distribution test of whole sequences ran, so neither is shown equal.
        note = (
            f"differs from host_loop (this engine's parts, same seed) at token {first} of "
            f"{len(ref)}: the loop changes what is drawn, or draws from a random stream "
            "host_loop does not share; no distribution test of whole sequences ran"
        )
    return {
        "loop_tokens_identical": first is None,
        "loop_first_divergence": first,
        "loop_note": note,
    }


def replaces_sampler(engine: Engine) -> bool:
    """Whether `engine` samples other than stock does: a technique filled the slot, or its
    occupant is not stock's. Read off the engine, not only `filled` (the declarations), so
    an engine that swapped the sampler without declaring it is tested all the same."""
    return "sampler" in engine.filled or engine.sampler is not stock_sampler


def replaces_loop(engine: Engine) -> bool:
    """Whether `engine`'s token loop is not stock's (see replaces_sampler)."""
    return "loop" in engine.filled or engine.loop is not host_loop


def judge_slots(
    rec: FidelityRecord,
    engine: Engine,
    heads: list[HeadLogits],
    prompt_ids: list[int],
    frames: int,
    sampling: SamplingConfig,
    seed: int,
) -> FidelityRecord:
    """`rec` with the sampler and loop slots measured wherever they are not stock's: within
    tolerance only if the sampler draws stock's distribution and the loop emits the
    reference loop's tokens (a plugin's `exact` there is measured, not taken on its word)."""
    update: dict[str, object] = {"logits_within_tolerance": rec.within_tolerance}
    ok = rec.within_tolerance
    tested: tuple[str, ...] = ()
    if replaces_sampler(engine):
        tv, bound = sampler_check(engine.sampler, heads, sampling, seed)
        update |= {"sampler_tv": tv, "sampler_tv_bound": bound, "sampler_draws": SAMPLER_DRAWS}
        ok, tested = ok and tv <= bound, (*tested, "sampler")
    if replaces_loop(engine):
        update |= loop_check(engine, prompt_ids, frames, sampling, seed)
        ok, tested = ok and bool(update["loop_tokens_identical"]), (*tested, "loop")
    return rec.model_copy(update={**update, **coverage(engine, tested), "within_tolerance": ok})


# A server's step is teacher-forced in a small server of its own (not the timed one's cache):
# the row under test sits between rows holding other prompts of other lengths and other
# tokens, so a mask, position or cache write that leaks across rows shows in its logits.
SERVER_ROWS = 3
SERVER_ROW = 1


@torch.inference_mode()
def server_teacher_forced(
    engine: Engine, prompt_ids: list[int], tokens: list[int], sampling: SamplingConfig
) -> tuple[torch.Tensor, Any, list[HeadLogits]]:
    """Row SERVER_ROW of the engine's server teacher-forced, its neighbours fed other
    prompts and tokens: [len(tokens), units + 1] canonical logits (step i predicting
    tokens[i]), the server's decoder, and the row's head output per step (for its sampler)."""
    assert engine.server is not None
    prompts = [prompt_ids[: max(2, len(prompt_ids) // 2)], prompt_ids, prompt_ids + prompt_ids[:7]]
    others = [tokens[::-1], tokens, tokens[1:] + tokens[:1]]
    longest = max(len(p) for p in prompts) + len(tokens) + 1
    dec = engine.server(engine, longest, sampling, 1, rows=SERVER_ROWS).dec
    rows, heads = [], []
    for logits, ids in dec.teacher_forced(prompts, others):
        col = ids[SERVER_ROW]
        end = int(dec.head.end)
        head = HeadLogits(logits[SERVER_ROW : SERVER_ROW + 1], col, end, slice(0, end))
        rows.append(canonical(engine, head))
        heads.append(head)
    return torch.stack(rows).float(), dec, heads


@torch.inference_mode()
def server_sampler_check(
    dec: Any, heads: list[HeadLogits], sampling: SamplingConfig, seed: int
) -> tuple[float, float]:
    """(max TV, bound): the server's sampler (`dec.draw`: SAMPLER_DRAWS rows of one head
    output, each its own seed) against stock's sampler on the same logits, end-of-audio
    masked, allowed and forced, as sampler_check does for a single-stream sampler."""
    cases = sampler_cases(heads)
    tv = 0.0
    for k, (head, allow_end, force_end, n) in enumerate(cases):
        ref = draw(stock_sampler, head, n, seed, sampling, allow_end, force_end)
        dev = head.logits.device
        got = dec.draw(
            head.logits.expand(n, -1),
            head.column_ids.expand(n, -1),
            torch.full((n,), dec.stop_from + k, dtype=torch.long, device=dev),
            torch.full((n,), force_end, dtype=torch.bool, device=dev),
            torch.arange(n, device=dev) + seed * 7919 + 1,  # other seeds than stock's
            torch.full((n,), allow_end or force_end, dtype=torch.bool, device=dev),
        )
        tv = max(tv, total_variation(ref, got.cpu()))
    support = min(sampling.top_k, heads[0].logits.shape[-1])
    return tv, tv_bound(SAMPLER_DRAWS, support, len(cases))


@dataclasses.dataclass
class Reference:
    """Stock's teacher-forced logits on one token sequence, and how any engine is judged
    against them: a fixed bar in fp32; in bf16/fp16 the noise floor of an fp32 upcast."""

    prompt_ids: list[int]
    tokens: list[int]
    stock: torch.Tensor
    fp32: torch.Tensor | None
    floor: FidelityRecord | None
    temperature: float
    top_k: int
    dtype: torch.dtype

    @classmethod
    def build(
        cls, model: RumikModel, prompt_ids: list[int], tokens: list[int], temperature: float,
        top_k: int,
    ) -> Reference:  # fmt: skip
        stock = teacher_forced(stock_engine(model), prompt_ids, tokens)
        fp32 = floor = None
        if model.dtype != torch.float32:
            fp32 = teacher_forced(stock_engine(upcast(model)), prompt_ids, tokens)
            floor = compare(fp32, stock, temperature, top_k, torch.float32)
        return cls(prompt_ids, tokens, stock, fp32, floor, temperature, top_k, model.dtype)

    def logits_record(self, other: torch.Tensor) -> FidelityRecord:
        """`other`'s canonical logits against stock's: the fixed fp32 bar, or in half
        precision the noise floor of the fp32 upcast (judge_half)."""
        rec = compare(self.stock, other, self.temperature, self.top_k, self.dtype)
        if self.fp32 is not None and self.floor is not None:
            vs32 = compare(self.fp32, other, self.temperature, self.top_k, torch.float32)
            rec = judge_half(rec, vs32, self.floor)
        return rec

    def judge_server(self, engine: Engine, sampling: SamplingConfig, seed: int) -> FidelityRecord:
        """The engine's server (many streams at once): one of its rows teacher-forced against
        stock's logits, and its sampler's draws against stock's sampler on that row's logits.
        Within tolerance only if both are."""
        other, dec, heads = server_teacher_forced(engine, self.prompt_ids, self.tokens, sampling)
        rec = self.logits_record(other)
        tv, bound = server_sampler_check(dec, heads, sampling, seed)
        return rec.model_copy(
            update={
                "covers": [*COVERS, "server's sampler"],
                "not_covered": {},
                "logits_within_tolerance": rec.within_tolerance,
                "sampler_tv": tv,
                "sampler_tv_bound": bound,
                "sampler_draws": SAMPLER_DRAWS,
                "within_tolerance": rec.within_tolerance and tv <= bound,
            }
        )

    def judge(
        self, engine: Engine, sampling: SamplingConfig | None = None, seed: int = 0
    ) -> FidelityRecord:
        """Teacher-forced logits against stock's; with `sampling`, also the sampler and loop
        wherever they are not stock's (judge_slots)."""
        heads: list[HeadLogits] = []  # kept only for a sampler test: full-vocab rows are big
        keep = heads if sampling is not None and replaces_sampler(engine) else None
        other = teacher_forced(engine, self.prompt_ids, self.tokens, keep)
        rec = self.logits_record(other).model_copy(update=coverage(engine))
        if sampling is None:
            return rec
        frames = -(-len(self.tokens) // engine.model.vocab.num_quantizers)  # >= the steps
        return judge_slots(rec, engine, heads, self.prompt_ids, frames, sampling, seed)
