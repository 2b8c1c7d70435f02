"""Next-token fidelity against stock, teacher-forced on one token sequence.

Every engine is fed the same prompt and the same generated tokens; at each step its head's
logits are placed in one canonical space (audio units, then end-of-audio) so heads of any
width compare. Exact techniques must stay within tolerance; approximate ones report how
far they move the distribution.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from orchestrate.api.records import FidelityRecord
from orchestrate.families.rumik.engine import Engine, HeadLogits, stock_engine
from orchestrate.families.rumik.model import RumikModel

# fp32: max |logit diff| over the std of stock's logits; only summation order differs.
FP32_TOLERANCE = 1e-3
# bf16/fp16 round every matmul and the residual stream, and a reordered sum rounds
# differently, so no fixed bar is honest. Both stock and the stack are measured against an
# fp32 upcast of the same weights; an exact stack must stay within this factor of stock's
# own rounding error (its "noise floor").
NOISE_FACTOR = 2.0


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
def teacher_forced(engine: Engine, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), units + 1] canonical logits, step i predicting tokens[i]."""
    device = engine.model.device
    decoder = engine.new_decoder(len(prompt_ids) + len(tokens) + 1)
    hidden = decoder.prefill(torch.tensor([prompt_ids], device=device))
    rows = []
    for step, tok in enumerate(tokens):
        rows.append(canonical(engine, engine.head(hidden, step)))
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

    def judge(self, engine: Engine) -> FidelityRecord:
        other = teacher_forced(engine, self.prompt_ids, self.tokens)
        rec = compare(self.stock, other, self.temperature, self.top_k, self.dtype)
        if self.fp32 is None or self.floor is None:
            return rec
        vs32 = compare(self.fp32, other, self.temperature, self.top_k, torch.float32)
        return judge_half(rec, vs32, self.floor)
