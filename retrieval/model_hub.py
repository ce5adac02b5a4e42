"""Where a configured model comes from: a local path, the Hugging Face cache, or the hub.

The online path is kept to one call (`fetch`), since it can only be exercised where a hub is
reachable; everything else works from local files.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

_TRUTHY = ("1", "true", "yes", "on")


class ModelNotInstalledError(LookupError):
    """The model is neither a local path nor in the local cache, and cannot be fetched now."""


def is_offline() -> bool:
    """True when the environment forbids hub access (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(
        os.environ.get(name, "").lower() in _TRUTHY
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def looks_like_path(name: str) -> bool:
    """A name meant as a filesystem path rather than a hub id like `org/model`."""
    return name.startswith(("/", "./", "../", "~")) or os.path.exists(name)


def hub_is_reachable(timeout_s: float = 3.0, endpoint: str | None = None) -> bool:
    """One TCP connect to the hub's endpoint (``endpoint``, else HF_ENDPOINT's). NOTE:
    huggingface_hub itself retries a dead network for about a minute; this answers in
    `timeout_s` at most."""
    if is_offline():
        return False
    from huggingface_hub import constants

    url = urlparse(endpoint or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def fetch(repo_id: str) -> Path:
    """Download `repo_id` into the Hugging Face cache (a no-op for files already there)."""
    if not hub_is_reachable():
        raise ModelNotInstalledError(f"{repo_id}: the model hub is not reachable from here")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id))
