"""The shape of a Llama-family decoder, read from a HF config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class RopeScaling:
    """RoPE frequency scaling: ``default`` (none), ``linear`` or ``llama3``."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


@dataclass(slots=True)
class ModelConfig:
    """Every size the model code needs; validated so that a bad checkpoint fails at load time."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {SUPPORTED_ARCHITECTURES}"
            )
        for name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that :meth:`from_dict` turns back into an equal config."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        scaling = self.rope_scaling
        out["rope_scaling"] = {n: getattr(scaling, n) for n in scaling.__dataclass_fields__}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        data["rope_scaling"] = RopeScaling(**data.get("rope_scaling", {}))
        return cls(**data)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (Llama, Mistral or Qwen2)."""
        arch = str(cfg.get("model_type", "")).lower()
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers 5 moved rope settings under rope_parameters; older files use rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        rope.update(cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        # NOTE: sliding-window attention is not implemented; capping the context at the window
        # keeps every supported sequence exact instead of silently attending too far.
        window = cfg.get("sliding_window")
        if window and (arch == "mistral" or cfg.get("use_sliding_window")):
            max_pos = min(max_pos, int(window))
        return cls(
            architecture=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=_rope_scaling_from_hf(rope),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: dict[str, Any],
        *,
        has_output_weight: bool,
        token_count: int | None = None,
        embedding_rows: int | None = None,
    ) -> ModelConfig:
        """Build from GGUF key/values (``llama.block_count`` and friends).

        Optional keys are derived as llama.cpp derives them. The vocabulary size is
        ``<arch>.vocab_size``, else the length of ``tokenizer.ggml.tokens`` (taken from ``meta``
        when it holds the list, else ``token_count``), else ``embedding_rows``, the row count of
        ``token_embd.weight``. :func:`engine.weights.gguf_loader.gguf_model_config` fills the
        last two from the file.
        """
        arch = str(meta.get("general.architecture", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; the engine runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return value

        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        # llama.cpp: the head size is attention.key_length, else embedding_length / head_count;
        # rope.dimension_count only says how much of it rotates (all of it, by default).
        head_dim = int(key("attention.key_length", hidden // max(num_heads, 1)))
        value_dim = int(key("attention.value_length", head_dim))
        rotary_dim = int(key("rope.dimension_count", head_dim))
        if value_dim != head_dim:
            raise ValueError(f"key length {head_dim} != value length {value_dim} is not supported")
        if rotary_dim != head_dim:
            raise ValueError(f"partial rotary ({rotary_dim} of {head_dim} dims) is not supported")
        max_pos = int(key("context_length", _DEFAULT_CONTEXT_LENGTH))
        window = meta.get(f"{arch}.attention.sliding_window")
        if window and arch == "mistral":  # same cap as from_hf_config: no sliding window here
            max_pos = min(max_pos, int(window))
        return cls(
            architecture=arch,
            num_layers=int(key("block_count")),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            vocab_size=_gguf_vocab_size(meta, arch, token_count, embedding_rows),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling_from_gguf(meta, arch),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
        )


# llama.cpp refuses a file without <arch>.context_length; this is transformers' LlamaConfig
# default (and from_hf_config's), a cap that errs short rather than past what was trained.
_DEFAULT_CONTEXT_LENGTH = 2048


def _gguf_vocab_size(
    meta: dict[str, Any], arch: str, token_count: int | None, embedding_rows: int | None
) -> int:
    # llama.cpp's order: the explicit key, then the token list. Real files often lack the key
    # (the Qwen2.5 GGUFs do), and llama.cpp's converter pads the token list to the embedding's
    # row count, so the list length is the model's vocabulary, padding included.
    explicit = meta.get(f"{arch}.vocab_size")
    if explicit is not None:
        return int(explicit)
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    if token_count is not None:
        return int(token_count)
    if embedding_rows is not None:
        return int(embedding_rows)
    raise ValueError(
        f"GGUF file has no {arch}.vocab_size, no tokenizer.ggml.tokens and no token_embd.weight"
    )


def _rope_scaling_from_gguf(meta: dict[str, Any], arch: str) -> RopeScaling:
    # llama.cpp reads a missing scaling type as "linear" and a missing (or zero) factor as 1, and
    # still accepts the old rope.scale_linear key for the factor.
    kind = str(meta.get(f"{arch}.rope.scaling.type", "linear"))
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    factor = float(factor or 1.0)
    if kind == "linear" and factor != 1.0:
        return RopeScaling(rope_type="linear", factor=factor)
    # NOTE: other types (yarn, ...) are ignored, as before; llama3 scaling travels as a
    # rope_freqs.weight tensor, not as keys.
    return RopeScaling()


def _rope_scaling_from_hf(rope: dict[str, Any]) -> RopeScaling:
    kind = str(rope.get("rope_type", rope.get("type", "default")))
    if kind == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=kind,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
    )
