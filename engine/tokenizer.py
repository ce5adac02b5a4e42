"""The model's tokenizer and chat template, from GGUF metadata or a Hugging Face directory.

A GGUF vocabulary is converted to a fast ``tokenizers`` tokenizer once (through transformers'
GGUF converter) and cached as tokenizer.json under ``cache_dir``, so later starts skip it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

# bumped when the cached conversion's layout changes
TOKENIZER_CACHE_VERSION = 1


def cache_key(source: str | Path) -> str:
    """A hex key that changes whenever the source file's path, size or mtime changes."""
    stat = Path(source).stat()
    ident = f"{TOKENIZER_CACHE_VERSION}|{Path(source).resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


class Tokenizer:
    """Text <-> token ids, special-token ids and chat-template rendering for one model."""

    def __init__(
        self,
        backend: FastTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: set[int],
        chat_template: str | None,
        add_bos_token: bool = False,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a tokenizer needs at least one end-of-sequence token id")
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = set(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._token_bytes: list[bytes] | None = None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, or None when the model has none."""
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        """The text of the lowest end-of-sequence id (what chat templates call ``eos_token``)."""
        return self.backend.id_to_token(min(self.eos_token_ids))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, the tokenizer's own post-processing
        runs (and BOS is prepended if the model asks for one and that did not add it).
        Special-token text inside ``text`` (``<|im_start|>``) maps to its special id."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            return [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Decode a growing window (or join :meth:`token_bytes`) when streaming,
        since one token may hold only part of a UTF-8 character."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (special tokens: their UTF-8 text).

        Concatenating these and decoding UTF-8 incrementally reproduces :meth:`decode`, except
        that SentencePiece models keep the leading space of the first word.
        """
        if self._token_bytes is None:
            self._token_bytes = _build_token_bytes(self.backend)
        if not 0 <= token_id < len(self._token_bytes):
            raise ValueError(f"token id {token_id} outside the vocabulary")
        return self._token_bytes[token_id]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the model's own Jinja chat template, sandboxed."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"chat messages need a 'role', got {message!r}")
        try:
            template = _jinja_env().from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed to render: {exc}") from exc

    @classmethod
    def from_model_path(cls, path: str | Path, cache_dir: str | Path | None = None) -> Tokenizer:
        """The tokenizer of a GGUF file or of a Hugging Face directory."""
        source = Path(path)
        if source.is_dir():
            return cls.from_hf_dir(source)
        if source.is_file() and source.suffix.lower() == ".gguf":
            return cls.from_gguf(source, cache_dir)
        raise ValueError(f"no GGUF file or Hugging Face directory at {source}")

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json and (if present) generation_config.json."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"{root} has no tokenizer.json")
        backend = FastTokenizer.from_file(str(root / "tokenizer.json"))
        cfg = _read_json(root / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        bos_id = _token_id(backend, cfg.get("bos_token"))
        eos_ids = {i for i in [_token_id(backend, cfg.get("eos_token"))] if i is not None}
        gen_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos else [])
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
        )

    @classmethod
    def from_gguf(cls, path: str | Path, cache_dir: str | Path | None = None) -> Tokenizer:
        """Build from GGUF metadata; with ``cache_dir`` the conversion is cached and reused."""
        cached = Path(cache_dir) / f"tokenizer-{cache_key(path)}" if cache_dir else None
        if cached is not None and (cached / "tokenizer.json").is_file():
            return cls._from_cache(cached)
        backend, meta = _convert_gguf(Path(path))
        if cached is not None:
            _write_cache(cached, backend, meta)
        return cls(backend, **meta)

    @classmethod
    def word_level(cls, vocab_size: int) -> Tokenizer:
        """A vocabulary of the words ``<t0>``..``<tN-1>``, the last one end-of-sequence: for
        runners with random weights (ModelRunner.from_config), whose output it can detokenize."""
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import WhitespaceSplit

        vocab = {f"<t{i}>": i for i in range(vocab_size)}
        backend = FastTokenizer(WordLevel(vocab, unk_token="<t0>"))
        backend.pre_tokenizer = WhitespaceSplit()  # one word, one token
        return cls(backend, bos_token_id=None, eos_token_ids={vocab_size - 1}, chat_template=None)

    @classmethod
    def _from_cache(cls, cached: Path) -> Tokenizer:
        meta = _read_json(cached / "meta.json")
        meta["eos_token_ids"] = set(meta["eos_token_ids"])
        return cls(FastTokenizer.from_file(str(cached / "tokenizer.json")), **meta)


def _convert_gguf(path: Path) -> tuple[FastTokenizer, dict[str, Any]]:
    from transformers import PreTrainedTokenizerFast

    from prefixrag.engine.weights.gguf_file import read_gguf_file

    # the lean header read: gguf-py's reader spent 15 s on a 151k-token vocabulary here
    meta = read_gguf_file(path).metadata
    # NOTE: the generic fast class, not AutoTokenizer: AutoTokenizer first loads the file's
    # model config through gguf-py's reader (the 1.5B benchmark model: 25 s of a 28 s start
    # against 2.5 s), and both build the same backend (the same tokenizer.json, checked on the
    # packaged model and the 1.5B)
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = {int(i) for i in (eos, eot) if i is not None} or {int(hf_tok.eos_token_id)}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return hf_tok.backend_tokenizer, {
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_ids": eos_ids,
        "chat_template": meta.get("tokenizer.chat_template"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }


def _write_cache(cached: Path, backend: FastTokenizer, meta: dict[str, Any]) -> None:
    # Build in a temporary sibling directory and rename it into place, so a reader never sees
    # a half-written cache entry.
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tokenizer-"))
    backend.save(str(tmp / "tokenizer.json"))
    plain = dict(meta, eos_token_ids=sorted(meta["eos_token_ids"]))
    (tmp / "meta.json").write_text(json.dumps(plain))
    try:
        os.replace(tmp, cached)
    except OSError:  # another process won the race; its copy is as good as ours
        for file in tmp.iterdir():
            file.unlink()
        tmp.rmdir()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_id(backend: FastTokenizer, token: str | dict[str, Any] | None) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _byte_level_decoder() -> dict[str, int]:
    # GPT-2's reversible map: printable bytes stand for themselves, the rest shift above 255.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _build_token_bytes(backend: FastTokenizer) -> list[bytes]:
    spec = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {spec.get("type")} | {d.get("type") for d in spec.get("decoders", [])}
    is_byte_level = "ByteLevel" in kinds
    specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    byte_decoder = _byte_level_decoder()
    out: list[bytes] = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(token_id) or ""
        if token in specials:
            out.append(token.encode())
        elif is_byte_level:
            out.append(bytes(byte_decoder[c] for c in token if c in byte_decoder))
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out.append(bytes([int(token[3:5], 16)]))
        else:
            out.append(token.replace("\u2581", " ").encode())
    return out
