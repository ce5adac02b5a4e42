"""Turns a batch of logits into one token id per sequence, honouring each sequence's parameters."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixrag.engine.sampling_params import SamplingParams


class Sampler:
    """Greedy rows are an argmax; the others go through temperature, top-k and top-p.

    A seeded request owns a ``torch.Generator`` that advances with every token it samples, so the
    same seed gives the same output whatever else is in the batch.
    """

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[int]:
        # logits: [num_seqs, vocab] float32
        if logits.shape[0] != len(params) or len(seq_ids) != len(params):
            raise ValueError("one row of logits, one seq id and one SamplingParams per sequence")
        token_ids = torch.argmax(logits, dim=-1).tolist()
        for row, (seq_id, p) in enumerate(zip(seq_ids, params, strict=True)):
            if p.temperature > 0:
                token_ids[row] = self._sample_row(logits[row], seq_id, p)
        return token_ids

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's random state."""
        self._generators.pop(seq_id, None)

    def _sample_row(self, row: torch.Tensor, seq_id: int, p: SamplingParams) -> int:
        row = row.float() / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            probs = _top_p_filter(probs, p.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator(seq_id, p)).item())

    def _generator(self, seq_id: int, p: SamplingParams) -> torch.Generator | None:
        if p.seed is None:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator().manual_seed(p.seed)
            self._generators[seq_id] = gen
        return gen


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
