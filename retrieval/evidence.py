"""Evidence spans: the sentences of each retrieved chunk that best answer the question.

A citation says which chunk an answer rests on; a span says which lines. Sentences are scored in
two stages, as retrieval itself is:
1. every sentence by the embedder's cosine to the question, plus a small bonus for the share of
   the question's terms it holds, plus another when it names code the question does not (a
   call, a snake_case or CamelCase name). The embedder alone favours the sentence that restates
   the question ("There are cases where it is useful to add information after the exception
   was caught.") over the one that answers it, which in technical text usually names the thing
   to use ("exceptions have a method add_note(note) ..."). Sentence vectors depend only on the
   chunk, so they are cached per chunk text (in float16: half the memory, and rounding far
   below the gaps that rank sentences), and a chunk seen before costs one matrix product.
   Embedding a new chunk's sentences is the expensive part (about 0.1 s per chunk on two CPU
   cores), so ingest embeds each new document's chunks once, caches them and hands them to
   the service to keep (`stored`; a restarted service `restore`s them; `warm` caches only);
2. when a cross-encoder is loaded, the `shortlist` best sentences of each chunk by stage 1 are
   scored again by it, in one batch, and its order wins.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefixrag.retrieval.embedder import Embedder
from prefixrag.retrieval.lexical.analyzer import Analyzer
from prefixrag.retrieval.reranker import Reranker
from prefixrag.retrieval.sentences import is_code_line, sentence_spans

# Weights next to the cosine, chosen on the tuning half of bench/data/python_docs_qa.json
# (bench/evidence_eval.py reports the sweep): the question-term share, and naming new code; and
# the share of the question's terms from which a sentence restates it (0.6 found one answer
# more on the tuning half, but by highlighting 10% more text).
TERM_WEIGHT = 0.3
CODE_WEIGHT = 0.3
EXTEND_MARGIN = 0.1
RESTATE_SHARE = 0.7
NEVER_RESTATES = float("inf")  # a restate_share no sentence reaches

# A name a reader types: a call ("add_note(", "str.join("), a snake_case, camelCase or CamelCase
# name. Dotted names without a call are left out: section numbers ("8.10") look the same.
_CODE_NAME = re.compile(r"\w+\(|\b\w+_\w+\b|\b[a-z]+[A-Z]\w*|\b[A-Z][a-z]+[A-Z]\w*")
# A sentence opening with one of these points back at the one before it, and reads as half a
# thought when highlighted alone ("It can be used when a statement is required ...").
_POINTS_BACK = re.compile(
    r"(?:It|Its|This|That|These|Those|They|Their|Such|Here|So|Thus|Hence|Therefore|Otherwise|"
    r"Also|For this|For that|In this|In that|To do this|Instead)\b"
)


@dataclass(slots=True, frozen=True)
class EvidenceSpan:
    """A sentence of a chunk: `text[start:end]` of the chunk's text, and its score (cosine-based
    or the cross-encoder's logit; comparable only within one question)."""

    start: int
    end: int
    score: float


@dataclass(slots=True, frozen=True)
class StoredSentences:
    """A chunk's sentences as a store keeps them, so a restarted service need not embed them
    again: `key` names the embedder, the splitting and the text (EvidenceFinder.key), `spans`
    are int32 [n, 2] character offsets and `vectors` float16 [n, dim] unit rows."""

    key: bytes
    spans: np.ndarray
    vectors: np.ndarray


@dataclass(slots=True)
class _ChunkSentences:
    spans: list[tuple[int, int]]
    vectors: np.ndarray  # float16 [len(spans), dim], unit rows
    terms: list[frozenset[str]]
    code_names: list[frozenset[str]]
    points_back: list[bool]
    is_code: list[bool]  # opens on a line of code (a doctest prompt, an indented line)


class EvidenceFinder:
    """Finds each chunk's best sentences for a question; thread-safe.

    `max_spans` spans are kept per chunk, best first; the cross-encoder, when there is one, reads
    the `shortlist` best sentences of each chunk (default: max(4, max_spans)). `cache_chunks`
    bounds the per-chunk sentence cache (about 8 KB per chunk with a 384-wide embedder). With
    `widen_back`, a chosen sentence that opens by pointing back ("It", "This", ...) takes the
    sentence before it along, so a span is still at most two sentences; one that holds at least
    `restate_share` of the question's terms restates it and takes the prose sentence after it
    along (`NEVER_RESTATES`: never). `code_aware_split` and `skip_headings` are
    `sentence_spans`' `code_aware` and `skip_headings`: prose is never joined onto the end of a
    code block, and a numbered section heading is in no sentence. With `code_bonus_on_code`
    off, a line of code earns no bonus for naming code (kept for the benchmark's comparison).
    """

    def __init__(
        self,
        *,
        max_spans: int = 2,
        shortlist: int | None = None,
        cache_chunks: int = 8192,
        term_weight: float = TERM_WEIGHT,
        code_weight: float = CODE_WEIGHT,
        extend_margin: float = EXTEND_MARGIN,
        widen_back: bool = True,
        code_aware_split: bool = True,
        skip_headings: bool = True,
        code_bonus_on_code: bool = True,
        restate_share: float = RESTATE_SHARE,
        analyzer: Analyzer | None = None,
    ) -> None:
        shortlist = max(4, max_spans) if shortlist is None else shortlist
        if max_spans < 1 or shortlist < max_spans:
            raise ValueError(f"need 1 <= max_spans <= shortlist, got {max_spans}, {shortlist}")
        if cache_chunks < 0 or term_weight < 0 or code_weight < 0:
            raise ValueError("cache_chunks, term_weight and code_weight must be >= 0")
        if not restate_share > 0:
            raise ValueError(f"restate_share must be > 0, got {restate_share}")
        self.max_spans = max_spans
        self.shortlist = shortlist
        self.cache_chunks = cache_chunks
        self.term_weight = term_weight
        self.code_weight = code_weight
        self.extend_margin = extend_margin
        self.widen_back = widen_back
        self.code_aware_split = code_aware_split
        self.skip_headings = skip_headings
        self.code_bonus_on_code = code_bonus_on_code
        self.restate_share = restate_share
        self.analyzer = analyzer if analyzer is not None else Analyzer()
        self._cache: OrderedDict[bytes, _ChunkSentences] = OrderedDict()
        self._lock = threading.Lock()

    def find(
        self,
        question: str,
        texts: Sequence[str],
        *,
        embedder: Embedder,
        reranker: Reranker | None = None,
        question_vector: np.ndarray | None = None,
    ) -> list[list[EvidenceSpan]]:
        """Per text, its best sentences for `question`, best first (empty for a text with no
        words). `question_vector` is the embedder's vector of the question when the caller has
        it already (retrieval computed it)."""
        if not texts:
            return []
        sentences = self._sentences(texts, embedder)
        if question_vector is None:
            question_vector = embedder.encode_query(question)
        question_terms = frozenset(self.analyzer.terms(question))
        question_code = frozenset(_CODE_NAME.findall(question))
        shares = [_shares(s, question_terms) for s in sentences]
        first = [
            self._first_stage(s, question_vector, share, question_code)
            for s, share in zip(sentences, shares, strict=True)
        ]
        ranked = [_best(scores, self.shortlist) for scores in first]
        if reranker is not None and reranker.is_available:
            ranked = self._rerank(question, texts, sentences, ranked, reranker)
        return [
            self._pick(chunk, order, scores, share)
            for chunk, order, scores, share in zip(sentences, ranked, first, shares, strict=True)
        ]

    @property
    def num_cached(self) -> int:
        """How many chunks' sentences are cached."""
        with self._lock:
            return len(self._cache)

    def warm(self, texts: Sequence[str], embedder: Embedder) -> None:
        """Embed and cache the sentences of `texts` not cached yet (at most `cache_chunks` of
        them: the newest win), so the first question citing them pays no embedding."""
        self._sentences(texts[-self.cache_chunks :] if self.cache_chunks else [], embedder)

    def key(self, text: str, embedder: Embedder) -> bytes:
        """What a chunk's sentences are cached under: its text, the embedder and the
        splitting (finders that split differently may share one store)."""
        split = (self.code_aware_split, self.skip_headings)
        model = embedder.model_name_or_path.encode() + b"\0%d%d\0" % split
        return hashlib.blake2b(model + text.encode(), digest_size=16).digest()

    def missing(self, texts: Sequence[str], embedder: Embedder) -> list[int]:
        """The positions of `texts` whose sentences are not cached."""
        keys = [self.key(t, embedder) for t in texts]
        with self._lock:
            return [n for n, key in enumerate(keys) if key not in self._cache]

    def stored(
        self, texts: Sequence[str], embedder: Embedder, *, batch: int = 256
    ) -> list[StoredSentences]:
        """`texts`' sentences in the form a store keeps, embedded where not cached (`batch`
        chunks per embedder call, so a long document never embeds in one go); the last
        `cache_chunks` stay cached."""
        out: list[StoredSentences] = []
        for lo in range(0, len(texts), batch):
            part = texts[lo : lo + batch]
            for text, chunk in zip(part, self._sentences(part, embedder), strict=True):
                spans = np.asarray(chunk.spans, dtype=np.int32).reshape(len(chunk.spans), 2)
                out.append(StoredSentences(self.key(text, embedder), spans, chunk.vectors))
        return out

    def restore(
        self, texts: Sequence[str], stored: Sequence[StoredSentences | None], embedder: Embedder
    ) -> int:
        """Caches the stored sentences of `texts` (None: nothing stored) whose key still
        matches (same text, embedder and splitting) and whose vectors have the embedder's
        width; returns how many it took."""
        dim = embedder.dim
        new: dict[bytes, _ChunkSentences] = {}
        for text, saved in zip(texts, stored, strict=True):
            if saved is None or saved.key != self.key(text, embedder):
                continue
            if saved.vectors.ndim != 2 or saved.vectors.shape != (len(saved.spans), dim):
                continue
            spans = [(int(lo), int(hi)) for lo, hi in saved.spans.tolist()]
            new[saved.key] = self._chunk(text, spans, saved.vectors)
        self._remember(new)
        return len(new)

    def _first_stage(
        self,
        chunk: _ChunkSentences,
        question_vector: np.ndarray,
        share: np.ndarray,
        question_code: frozenset[str],
    ) -> np.ndarray:
        scores: np.ndarray = chunk.vectors.astype(np.float32) @ question_vector.astype(np.float32)
        if self.term_weight:
            scores = scores + self.term_weight * share
        if self.code_weight and chunk.spans:
            names_new_code = [
                bool(names - question_code) and (self.code_bonus_on_code or not is_code)
                for names, is_code in zip(chunk.code_names, chunk.is_code, strict=True)
            ]
            scores = scores + self.code_weight * np.asarray(names_new_code, dtype=np.float32)
        return scores

    def _pick(
        self,
        chunk: _ChunkSentences,
        ranked: list[tuple[int, float]],
        first: np.ndarray,
        share: np.ndarray,
    ) -> list[EvidenceSpan]:
        """The best sentences as spans, each widened to a neighbour that scores within
        `extend_margin` of it in the first stage (an answer often takes two sentences: "The
        pass statement does nothing. It can be used when ..."), or else, with `widen_back`, to
        the sentence before one that points back at it, or else to the prose sentence after one
        that restates the question (holds `restate_share` of its terms): a section often opens
        by restating what it answers, and answers next ("... use a list as a stack, where the
        last element added is the first element retrieved." "To add an item ..., use
        append().")."""
        spans: list[EvidenceSpan] = []
        used: set[int] = set()
        for i, score in ranked:
            if len(spans) == self.max_spans:
                break
            if i in used:
                continue
            lo = hi = i
            neighbours = [j for j in (i - 1, i + 1) if 0 <= j < len(chunk.spans) and j not in used]
            if neighbours:
                j = max(neighbours, key=lambda j: float(first[j]))
                if first[j] >= first[i] - self.extend_margin:
                    lo, hi = min(i, j), max(i, j)
            if lo == hi and self.widen_back and chunk.points_back[i] and i - 1 in neighbours:
                lo = i - 1
            restates = lo == hi and share[i] >= self.restate_share
            if restates and i + 1 in neighbours and not chunk.is_code[i + 1]:
                hi = i + 1
            used.update(range(lo, hi + 1))
            spans.append(EvidenceSpan(chunk.spans[lo][0], chunk.spans[hi][1], score))
        return spans

    def _rerank(
        self,
        question: str,
        texts: Sequence[str],
        sentences: list[_ChunkSentences],
        shortlists: list[list[tuple[int, float]]],
        reranker: Reranker,
    ) -> list[list[tuple[int, float]]]:
        pairs = [
            (c, i)
            for c, (text, chunk, ranked) in enumerate(
                zip(texts, sentences, shortlists, strict=True)
            )
            for i, _ in ranked
        ]
        sentence_texts = [texts[c][slice(*sentences[c].spans[i])] for c, i in pairs]
        scores = reranker.score(question, sentence_texts)
        if scores is None:  # the model went away between the check and the call
            return shortlists
        reranked: list[list[tuple[int, float]]] = [[] for _ in texts]
        for (c, i), score in zip(pairs, scores.tolist(), strict=True):
            reranked[c].append((i, float(score)))
        return [sorted(ranked, key=lambda item: -item[1]) for ranked in reranked]

    def _sentences(self, texts: Sequence[str], embedder: Embedder) -> list[_ChunkSentences]:
        keys = [self.key(t, embedder) for t in texts]
        found: dict[int, _ChunkSentences] = {}
        with self._lock:
            for n, key in enumerate(keys):
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    found[n] = hit
        missing = [n for n in range(len(texts)) if n not in found]
        if missing:
            # one batch for every new chunk's sentences: the embedder's cost is per call
            spans = {n: self._split(texts[n]) for n in missing}
            flat = [texts[n][lo:hi] for n in missing for lo, hi in spans[n]]
            vectors = embedder.encode(flat)
            row = 0
            for n in missing:
                count = len(spans[n])
                found[n] = self._chunk(texts[n], spans[n], vectors[row : row + count])
                row += count
            self._remember({keys[n]: found[n] for n in missing})
        return [found[n] for n in range(len(texts))]

    def _split(self, text: str) -> list[tuple[int, int]]:
        return sentence_spans(
            text, code_aware=self.code_aware_split, skip_headings=self.skip_headings
        )

    def _chunk(
        self, text: str, spans: list[tuple[int, int]], vectors: np.ndarray
    ) -> _ChunkSentences:
        sentences = [text[lo:hi] for lo, hi in spans]
        return _ChunkSentences(
            spans,
            vectors.astype(np.float16),
            [frozenset(self.analyzer.terms(s)) for s in sentences],
            [frozenset(_CODE_NAME.findall(s)) for s in sentences],
            [_POINTS_BACK.match(s) is not None for s in sentences],
            [is_code_line(text, lo) for lo, _ in spans],
        )

    def _remember(self, new: dict[bytes, _ChunkSentences]) -> None:
        with self._lock:
            for key, value in new.items():
                self._cache[key] = value
                self._cache.move_to_end(key)
            while len(self._cache) > self.cache_chunks:
                self._cache.popitem(last=False)


def _shares(chunk: _ChunkSentences, question_terms: frozenset[str]) -> np.ndarray:
    """Per sentence, the share of the question's terms it holds."""
    if not question_terms:
        return np.zeros(len(chunk.spans), dtype=np.float32)
    held = [len(question_terms & terms) for terms in chunk.terms]
    return np.asarray(held, dtype=np.float32) / len(question_terms)


def _best(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    order = np.argsort(-scores, kind="stable")[:k]
    return [(int(i), float(scores[i])) for i in order]
