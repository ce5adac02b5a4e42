"""A GGUF model named by its place on the Hugging Face hub, the way llama.cpp's ``-hf`` and
Ollama's ``hf.co/`` names work: fetched once into the hub's local cache, then read from there.

References (an optional ``hf.co/`` or ``https://huggingface.co/`` in front):
- ``org/repo/file.gguf``: that file;
- ``org/repo:Q5_K_M``: the repo's one GGUF whose name carries that quantization;
- ``org/repo``: its Q4_K_M, the type llama.cpp picks too.

A fetched file is checked from its header before it counts as fetched (a GGUF, whole, of an
architecture and tensor types the engine runs) and, where the hub gives the file's sha256 (its
etag for large files), against that. A file that fails is taken out of the cache again, so no
later start finds half a model there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from prefixrag.retrieval.model_hub import hub_is_reachable, looks_like_path

logger = logging.getLogger(__name__)

DEFAULT_QUANT = "Q4_K_M"
_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
_NAME_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# llama-gguf-split's shard names; such a model is several files
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ModelFetchError(ValueError):
    """A hub model that cannot be had: a bad reference, a missing repo or file, a download
    that failed, or a file the engine cannot run. The message says which and what to do."""


@dataclass(frozen=True, slots=True)
class HubGGUF:
    """A GGUF on the hub: ``repo_id`` and either ``filename`` or a ``quant`` tag to find it by."""

    repo_id: str
    filename: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        if self.filename:
            return f"{self.repo_id}/{self.filename}"
        return f"{self.repo_id}:{self.quant}"


def parse_hub_gguf(reference: str) -> HubGGUF | None:
    """The hub GGUF that ``reference`` names, or None where it names a local path."""
    if looks_like_path(reference):
        return None
    name = reference
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name.removeprefix(prefix)
            break
    name, _, quant = name.partition(":")
    parts = name.strip("/").split("/")
    if len(parts) < 2 or not all(_NAME_PART.match(p) for p in parts):
        return None
    repo_id = "/".join(parts[:2])
    if len(parts) == 2:
        if parts[1].lower().endswith(".gguf"):
            return None  # a relative path to a file that is not there
        return HubGGUF(repo_id, quant=quant or DEFAULT_QUANT)
    filename = "/".join(parts[2:])
    if quant or not filename.lower().endswith(".gguf"):
        raise ModelFetchError(
            f"{reference}: name a .gguf file (org/repo/file.gguf) or a quantization "
            f"(org/repo:{DEFAULT_QUANT}), not both"
        )
    return HubGGUF(repo_id, filename=filename)


def pick_file(ref: HubGGUF, files: list[str]) -> str:
    """The one file of ``files`` that ``ref`` means; ModelFetchError naming the choices."""
    if ref.filename:
        return ref.filename
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    tag = re.compile(rf"(?<![a-z0-9]){re.escape((ref.quant or '').lower())}(?![a-z0-9_])")
    matches = [f for f in ggufs if tag.search(Path(f).name.lower())]
    whole = [f for f in matches if not _SHARD.search(f)]
    if len(whole) == 1:
        return whole[0]
    if len(whole) > 1:
        raise ModelFetchError(
            f"{ref}: several files match, name one as {ref.repo_id}/<file>: {', '.join(whole)}"
        )
    if matches:
        raise ModelFetchError(
            f"{ref}: the {ref.quant} model is split into {len(matches)} files, which the "
            "engine does not read; join them with llama.cpp's llama-gguf-split --merge"
        )
    found = ", ".join(sorted(ggufs)) or "none"
    raise ModelFetchError(f"{ref}: no {ref.quant} GGUF in the repo; its GGUF files: {found}")


def cached_gguf(ref: HubGGUF, cache_dir: str | Path | None = None) -> Path | None:
    """The file ``ref`` names if an earlier fetch left it in the cache (no network asked)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if ref.filename:
        hit = try_to_load_from_cache(ref.repo_id, ref.filename, cache_dir=cache_dir)
        return Path(hit) if isinstance(hit, str) else None
    repo_dir = Path(cache_dir or constants.HF_HUB_CACHE) / (
        "models--" + ref.repo_id.replace("/", "--")
    )
    try:
        commit = (repo_dir / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = repo_dir / "snapshots" / commit
    files = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf") if p.exists()]
    try:
        return snapshot / pick_file(ref, files)
    except ModelFetchError:
        return None


def fetch_gguf(
    ref: HubGGUF, *, endpoint: str | None = None, cache_dir: str | Path | None = None
) -> Path:
    """Download ``ref`` into the cache (huggingface_hub shows the progress bar and resumes a
    dropped connection where it broke off), check it, and return its path there."""
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError

    # HF_ENDPOINT read now: huggingface_hub read it once, at its import
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    where = endpoint
    if not hub_is_reachable(endpoint=endpoint):  # False offline (HF_HUB_OFFLINE) too
        raise ModelFetchError(f"{ref}: not in the local cache, and {where} is not reachable")
    try:
        if ref.filename:
            filename = ref.filename
        else:
            filename = pick_file(ref, HfApi(endpoint=endpoint).list_repo_files(ref.repo_id))
        path = Path(hf_hub_download(ref.repo_id, filename, endpoint=endpoint, cache_dir=cache_dir))
    except RepositoryNotFoundError:
        raise ModelFetchError(
            f"{ref}: no model repository {ref.repo_id} on {where} (or it needs a token: set "
            "HF_TOKEN)"
        ) from None
    except EntryNotFoundError:
        raise ModelFetchError(f"{ref}: {ref.repo_id} has no file {filename}") from None
    except Exception as err:
        # NOTE: broad on purpose: a dropped connection that outlives huggingface_hub's retries
        # surfaces as its HTTP client's own error type. It removes its partial file.
        raise ModelFetchError(
            f"{ref}: the download failed ({type(err).__name__}: {err}); run "
            "`prefixrag models fetch` again"
        ) from None
    from prefixrag.engine.weights import check_gguf

    try:
        _check_sha256(path)
        config = check_gguf(path)
    except ValueError as err:
        _drop_from_cache(path)
        raise ModelFetchError(f"{ref}: {err}") from None
    logger.info("%s: %s, %s layers, in %s", ref, config.architecture, config.num_layers, path)
    return path


def _check_sha256(path: Path) -> None:
    # the cache names a blob by its etag, which for a large (LFS) file is the sha256 of its bytes
    etag = path.resolve().name
    if not _SHA256.match(etag):
        return
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != etag:
        raise ValueError(f"the downloaded bytes have sha256 {digest.hexdigest()}, not {etag}")


def _drop_from_cache(path: Path) -> None:
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path:
        blob.unlink(missing_ok=True)


def local_llm(reference: str) -> str:
    """The local path of the model ``reference`` names: a path as given, a hub GGUF from the
    cache, or fetched into it at first use."""
    ref = parse_hub_gguf(reference)
    if ref is None:
        return reference
    hit = cached_gguf(ref)
    if hit is not None:
        return str(hit)
    logger.info("llm: fetching %s from the hub (once; later starts read the cache)", ref)
    return str(fetch_gguf(ref))
