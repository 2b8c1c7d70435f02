"""Rumik's token layout: text ids, then 8 interleaved Mimi codebooks, then specials.

Audio unit ids are code-major, codebook-minor: id = first_unit_id + 8 * code + q, so one
codebook's rows are every 8th row of the output head (not a contiguous block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AudioVocab:
    first_unit_id: int
    codebook_size: int
    num_quantizers: int
    end_id: int  # end-of-audio ("</audio>")
    vocab_size: int

    @property
    def num_units(self) -> int:
        return self.codebook_size * self.num_quantizers

    @property
    def last_unit_id(self) -> int:
        return self.first_unit_id + self.num_units - 1

    def candidate_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Every token speech may sample: all units, then end-of-audio last."""
        units = torch.arange(self.first_unit_id, self.last_unit_id + 1, device=device)
        return torch.cat([units, torch.tensor([self.end_id], device=device)])

    def codebook_ids(self, q: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Codebook q's units (stride 8), then end-of-audio last."""
        units = (
            self.first_unit_id
            + q
            + self.num_quantizers * torch.arange(self.codebook_size, device=device)
        )
        return torch.cat([units, torch.tensor([self.end_id], device=device)])

    def tokens_to_codes(self, tokens: list[int]) -> torch.Tensor:
        """Generated ids -> codec codes [1, Q, frames].

        A token that breaks the q0..q7 round robin drops the partial frame and resyncs, as
        the reference assembler does, so one bad token costs one frame, not the clip.
        """
        frames: list[list[int]] = []
        frame: list[int] = []
        for tid in tokens:
            if tid == self.end_id:
                break
            if not self.first_unit_id <= tid <= self.last_unit_id:
                frame = []
                continue
            code, q = divmod(tid - self.first_unit_id, self.num_quantizers)
            if q == len(frame):
                frame.append(code)
                if len(frame) == self.num_quantizers:
                    frames.append(frame)
                    frame = []
            else:
                frame = [code] if q == 0 else []
        if not frames:
            return torch.zeros(1, self.num_quantizers, 0, dtype=torch.long)
        return torch.tensor(frames, dtype=torch.long).T.unsqueeze(0)

    def positional_codes(self, tokens: list[int]) -> torch.Tensor:
        """Token i fills codebook i % Q of frame i // Q, whatever codebook it names.

        Used under a length policy: random weights pick codebooks at random, and the
        resyncing assembler would drop almost every frame, so the codec would decode a
        different (near-empty) length per stack. With real weights that keep the order,
        both assemblers give the same frames.
        """
        n = len(tokens) // self.num_quantizers * self.num_quantizers
        return self.positional_codes_rows(torch.tensor([tokens[:n]], dtype=torch.long))

    def positional_codes_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """`positional_codes` of each row of `tokens` [rows, frames * Q] (whole frames):
        [rows, Q, frames], for streams decoded together."""
        codes = (tokens - self.first_unit_id).clamp(0, self.num_units - 1) // self.num_quantizers
        return codes.view(len(tokens), -1, self.num_quantizers).transpose(1, 2)


def build_prompt(text: str, voice: str, delivery: str | None) -> str:
    """Upstream prompt format; [BOS] is added by the tokenizer."""
    text = text.strip()
    if delivery and "<description=" not in text:
        text = f'<description="{delivery.strip()}"> {text}'
    return f"<text>{voice}: {text}<audio>"


class ByteTokenizer:
    """Stand-in tokenizer for random-weight presets, which have no trained vocabulary.

    UTF-8 bytes map to ids 16..271; the prompt's control strings map to the specials that
    follow the audio units. Only the prompt length matters to speed; real weights load the
    checkpoint's own tokenizer instead.
    """

    BYTE_OFFSET = 16

    def __init__(self, vocab: AudioVocab):
        first_special = vocab.first_unit_id + vocab.num_units
        self.bos_id = first_special + 3
        self.specials = {
            "</audio>": vocab.end_id,
            "<audio>": first_special + 1,
            "<text>": first_special + 2,
        }
        if vocab.first_unit_id < self.BYTE_OFFSET + 256:
            raise ValueError("vocabulary too small for the byte tokenizer")

    def encode(self, prompt: str) -> list[int]:
        ids = [self.bos_id]
        i = 0
        while i < len(prompt):
            for s, sid in self.specials.items():
                if prompt.startswith(s, i):
                    ids.append(sid)
                    i += len(s)
                    break
            else:
                ids.extend(self.BYTE_OFFSET + b for b in prompt[i].encode())
                i += 1
        return ids
