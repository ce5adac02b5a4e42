"""Turns a batch of logits into one token id per sequence, honouring each sequence's parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixrag.engine.outputs import TokenLogprob
from prefixrag.engine.sampling.params import SamplingParams
from prefixrag.engine.sampling.penalties import TokenCounts

# Stands in for the token of a row that could not be sampled; never a real token id.
FAILED_TOKEN = -1


class SamplingError(RuntimeError):
    """Some rows of a batch could not be sampled; every other row was.

    ``errors`` maps each failed seq id to its cause. ``token_ids`` has one entry per row, the
    sampled token or :data:`FAILED_TOKEN`, so the caller can go on with the other sequences
    without sampling them again (which would advance their seeded streams a second time).
    """

    def __init__(
        self,
        token_ids: list[int],
        errors: dict[int, Exception],
        logprobs: list[TokenLogprob | None] | None = None,
    ) -> None:
        causes = "; ".join(f"seq {i}: {type(e).__name__}: {e}" for i, e in errors.items())
        super().__init__(f"sampling failed for {causes}")
        self.token_ids = token_ids
        self.errors = errors
        self.logprobs = logprobs if logprobs is not None else [None] * len(token_ids)

    @property
    def seq_ids(self) -> list[int]:
        """The sequences that got no token."""
        return list(self.errors)


@dataclass(slots=True)
class SamplerOutput:
    """One token per row, and its log-probabilities where the row's params ask for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def new_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``. ``torch.multinomial`` only takes one that
    lives where the probabilities do, and a seed gives the same stream on a given device."""
    return torch.Generator(device=device).manual_seed(seed)


def greedy_token_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, a NaN counting as the largest). On CPU
    through numpy, whose vectorized argmax takes 5 us on a 49,152-token row where torch's takes
    40: at batch 1 that is most of the sampler's share of a decode step. Same answer either way."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.contiguous().numpy().argmax(axis=-1).tolist()
    return torch.argmax(logits, dim=-1).tolist()


class Sampler:
    """Every row's logits first get its bias and penalties (sampling/penalties.py); then greedy
    rows are an argmax and the others go through temperature, top-k, min-p and top-p.

    A seeded request owns a ``torch.Generator`` per device its logits come from (made on first
    use), which advances with every token it samples, so the same seed gives the same output
    whatever else is in the batch. A request with penalties has its token counts kept here
    too: call :meth:`start` with its prompt before its first step, :meth:`release` at its end.

    A row that fails (bad parameters, non-finite probabilities) costs only its own sequence:
    :meth:`sample` samples the other rows, then raises :class:`SamplingError` naming it.
    """

    def __init__(self) -> None:
        self._generators: dict[int, dict[torch.device, torch.Generator]] = {}
        self._counts = TokenCounts()

    def start(self, seq_id: int, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Note a new sequence; only one with penalties needs it (the prompt counts for the
        repetition penalty)."""
        if params.has_penalties:
            self._counts.start(seq_id, prompt_token_ids)

    def sample(
        self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[int]:
        """One token id per row (see :meth:`sample_with_logprobs`)."""
        return self.sample_with_logprobs(logits, seq_ids, params).token_ids

    def sample_with_logprobs(
        self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams]
    ) -> SamplerOutput:
        """One token id per row, with the log-probabilities of the rows that ask for them."""
        # logits: [num_seqs, vocab] float32
        if logits.shape[0] != len(params) or len(seq_ids) != len(params):
            raise ValueError("one row of logits, one seq id and one SamplingParams per sequence")
        adjusted = self._counts.apply(logits, seq_ids, params)
        token_ids = greedy_token_ids(adjusted)
        errors: dict[int, Exception] = {}
        for row, (seq_id, p) in enumerate(zip(seq_ids, params, strict=True)):
            if p.temperature > 0:
                try:
                    token_ids[row] = self._sample_row(adjusted[row], seq_id, p)
                except Exception as exc:  # this request's own failure: the other rows go on
                    token_ids[row] = FAILED_TOKEN
                    errors[seq_id] = exc
        for seq_id, token_id, p in zip(seq_ids, token_ids, params, strict=True):
            if p.has_penalties and token_id != FAILED_TOKEN:
                self._counts.record(seq_id, token_id)
        # the model's raw distribution, as OpenAI and vLLM report it (see SamplingParams)
        logprobs = token_logprobs(logits, token_ids, params)
        if errors:
            raise SamplingError(token_ids, errors, logprobs)
        return SamplerOutput(token_ids, logprobs)

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's random state and token counts."""
        self._generators.pop(seq_id, None)
        self._counts.release(seq_id)

    def _sample_row(self, row: torch.Tensor, seq_id: int, p: SamplingParams) -> int:
        # shifted so the largest logit is 0 first: a tiny temperature then sends the others to
        # -inf (the greedy limit) instead of overflowing them all to inf, which softmax makes NaN
        # (and float32 would round a temperature below ~1e-38 to 0, making 0 / 0)
        row = row.float()
        row = (row - row.max()) / max(p.temperature, 1e-20)
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.min_p > 0.0:
            # min-p scales with the top token's probability: strict when the model is sure
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            probs = _top_p_filter(probs, p.top_p)
        generator = self._generator(seq_id, p, probs.device)
        return int(torch.multinomial(probs, 1, generator=generator).item())

    def _generator(
        self, seq_id: int, p: SamplingParams, device: torch.device
    ) -> torch.Generator | None:
        if p.seed is None:
            return None
        per_device = self._generators.setdefault(seq_id, {})
        gen = per_device.get(device)
        if gen is None:
            gen = new_generator(device, p.seed)
            per_device[device] = gen
        return gen


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """Per row: the sampled token's log-softmax over ``logits`` and the ``params.logprobs``
    most likely tokens, or None where the row asks for none or got no token."""
    # logits: [num_seqs, vocab]
    rows = [
        r for r, p in enumerate(params) if p.logprobs is not None and token_ids[r] != FAILED_TOKEN
    ]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # [num_rows, vocab]
    chosen = torch.tensor([token_ids[r] for r in rows], device=logits.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen).squeeze(1).tolist()
    k = max(params[r].logprobs or 0 for r in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if k:  # one topk for the batch at the largest k asked, cut per row below
        values, ids = torch.topk(logprobs, k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for i, r in enumerate(rows):
        n = params[r].logprobs or 0
        top = list(zip(top_ids[i][:n], top_values[i][:n], strict=True))
        out[r] = TokenLogprob(token_ids[r], chosen_logprobs[i], top)
    return out
