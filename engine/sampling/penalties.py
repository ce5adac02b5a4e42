"""The logit adjustments that depend on what a sequence has seen: its prompt and its output.

OpenAI's ``frequency_penalty`` and ``presence_penalty`` count the generated tokens; vLLM's
``repetition_penalty`` looks at every token seen, prompt included. ``logit_bias`` is a fixed
per-request offset and lives here too, since it is applied in the same pass, and so is the
``no_repeat_ngram_size`` ban, which a weak model needs to stop looping on one sentence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixrag.engine.sampling.params import SamplingParams


class TokenCounts:
    """Per sequence: how often each token was generated, and which tokens its prompt holds.

    The counts grow by one token per :meth:`record` instead of being recounted over the whole
    sequence each step, so a step costs O(vocab) per penalised row whatever the length. A
    sequence's prompt is given once (:meth:`start`) and turned into a mask on the logits'
    device at its first step; one never started counts as having an empty prompt.
    """

    def __init__(self) -> None:
        self._prompts: dict[int, Sequence[int]] = {}
        self._counts: dict[int, torch.Tensor] = {}  # seq id -> [vocab] float32
        self._in_prompt: dict[int, torch.Tensor] = {}  # seq id -> [vocab] bool
        self._ngrams: dict[int, GeneratedNgrams] = {}

    def start(self, seq_id: int, prompt_token_ids: Sequence[int]) -> None:
        """Remember the prompt of a sequence whose params have penalties."""
        self._prompts[seq_id] = prompt_token_ids

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence."""
        self._prompts.pop(seq_id, None)
        self._counts.pop(seq_id, None)
        self._in_prompt.pop(seq_id, None)
        self._ngrams.pop(seq_id, None)

    def record(self, seq_id: int, token_id: int) -> None:
        """Count a token the sequence just generated (only sequences with penalties)."""
        counts = self._counts.get(seq_id)
        if counts is not None:
            counts[token_id] += 1
        ngrams = self._ngrams.get(seq_id)
        if ngrams is not None:
            ngrams.append(token_id)

    def apply(
        self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams]
    ) -> torch.Tensor:
        """The logits with every row's bias and penalties applied, vectorised over the rows
        that have them; ``logits`` itself when no row has any."""
        # logits: [num_seqs, vocab] float32
        biased = [row for row, p in enumerate(params) if p.logit_bias]
        penalised = [row for row, p in enumerate(params) if p.has_penalties]
        if not biased and not penalised:
            return logits
        logits = logits.clone()
        if biased:
            _add_bias(logits, biased, params)
        banning = [row for row in penalised if params[row].no_repeat_ngram_size > 0]
        if banning:
            self._ban_repeats(logits, banning, seq_ids, params)
        if penalised:
            rows = torch.tensor(penalised, device=logits.device)
            states = [self._state(seq_ids[r], logits) for r in penalised]
            counts = torch.stack([c for c, _ in states])  # [num_penalised, vocab]
            in_prompt = torch.stack([m for _, m in states])
            logits[rows] = apply_penalties(
                logits[rows], counts, in_prompt, [params[r] for r in penalised]
            )
        return logits

    def _ban_repeats(
        self,
        logits: torch.Tensor,
        rows: list[int],
        seq_ids: Sequence[int],
        params: Sequence[SamplingParams],
    ) -> None:
        row_ids: list[int] = []
        token_ids: list[int] = []
        for row in rows:
            size = params[row].no_repeat_ngram_size
            ngrams = self._ngrams.setdefault(seq_ids[row], GeneratedNgrams(size))
            banned = ngrams.banned_next()
            row_ids.extend([row] * len(banned))
            token_ids.extend(banned)
        if token_ids:
            device = logits.device
            index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
            logits.index_put_(index, torch.tensor(float("-inf"), device=device))

    def _state(self, seq_id: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = self._counts.get(seq_id)
        if counts is None:
            vocab, device = logits.shape[-1], logits.device
            counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = self._prompts.pop(seq_id, ())
            if prompt:
                in_prompt[torch.tensor(list(prompt), device=device)] = True
            self._counts[seq_id], self._in_prompt[seq_id] = counts, in_prompt
        return counts, self._in_prompt[seq_id]


class GeneratedNgrams:
    """The n-grams a sequence has generated, indexed by their first n - 1 tokens, so the tokens
    that would repeat one are found in O(1) per step."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"an n-gram needs n >= 1, got {size}")
        self.size = size
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], set[int]] = {}

    def append(self, token_id: int) -> None:
        """Add a generated token (and the n-gram it completes)."""
        self.tokens.append(token_id)
        if len(self.tokens) >= self.size:
            head = tuple(self.tokens[len(self.tokens) - self.size : -1])
            self._next.setdefault(head, set()).add(token_id)

    def banned_next(self) -> list[int]:
        """The tokens that would complete an n-gram generated before, sorted."""
        if len(self.tokens) < self.size - 1:
            return []
        head = tuple(self.tokens[len(self.tokens) - self.size + 1 :]) if self.size > 1 else ()
        return sorted(self._next.get(head, ()))


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    params: Sequence[SamplingParams],
) -> torch.Tensor:
    """Repetition penalty on every token seen, then frequency and presence penalties on the
    generated ones; one row per entry of ``params``.

    The repetition penalty goes first, on the model's own logits, so that its "divide if
    positive" reads the sign the model gave and not one the additive penalties flipped.
    """
    # logits, counts: [rows, vocab] float32; in_prompt: [rows, vocab] bool
    device = logits.device
    rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    generated = counts > 0
    seen = in_prompt | generated
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * generated.float()


def _add_bias(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> None:
    # one scattered add for all biased rows: their (row, token, bias) triples side by side
    row_ids = [r for r in rows for _ in params[r].logit_bias]
    token_ids = [t for r in rows for t in params[r].logit_bias]
    values = [v for r in rows for v in params[r].logit_bias.values()]
    device = logits.device
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)
