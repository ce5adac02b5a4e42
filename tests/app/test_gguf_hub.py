"""A hub GGUF fetched end to end from a local server with the hub's URL layout: found by its
quantization, resumed after a dropped connection, read from the cache once fetched, and refused
(with nothing left in the cache) when it is missing, cut short or not a model the engine runs."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from prefixrag.app.services.gguf_hub import (
    HubGGUF,
    ModelFetchError,
    cached_gguf,
    fetch_gguf,
    parse_hub_gguf,
    pick_file,
)
from tests.app.hub_server import FakeHub
from tests.engine.test_mapped_weights import write_qwen2_gguf

REPO = "acme/Tiny-Qwen-GGUF"
FILE = "tiny-qwen-q4_k_m.gguf"


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("hub") / FILE
    write_qwen2_gguf(str(path))
    return path.read_bytes()


@pytest.fixture
def hub(monkeypatch, model_bytes):
    from huggingface_hub import constants

    # the suite runs offline (conftest); this server is the one hub these tests may reach
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    server = FakeHub(
        repos={REPO: {FILE: model_bytes, "tiny-qwen-q8_0.gguf": b"x", "README.md": b"hi"}}
    ).start()
    yield server
    server.stop()


def _cache_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


def test_references_parse_as_llama_cpp_and_ollama_write_them():
    assert parse_hub_gguf("acme/Model-GGUF") == HubGGUF("acme/Model-GGUF", quant="Q4_K_M")
    assert parse_hub_gguf("hf.co/acme/Model-GGUF:Q5_K_M") == HubGGUF(
        "acme/Model-GGUF", quant="Q5_K_M"
    )
    assert parse_hub_gguf("https://huggingface.co/acme/M/sub/m.gguf") == HubGGUF(
        "acme/M", filename="sub/m.gguf"
    )
    for path in ("./m.gguf", "/models/m.gguf", "models/m.gguf", "m.gguf"):
        assert parse_hub_gguf(path) is None
    with pytest.raises(ModelFetchError, match="not both"):
        parse_hub_gguf("acme/M/m.gguf:Q4_K_M")


def test_a_quantization_picks_one_whole_file():
    files = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-q8_0.gguf", "mmproj-Q4_K_M.gguf", "a.md"]
    assert pick_file(HubGGUF("a/b", quant="Q4_K_M"), files) == "m-Q4_K_M.gguf"
    assert pick_file(HubGGUF("a/b", quant="q8_0"), files) == "m-q8_0.gguf"
    with pytest.raises(ModelFetchError, match=r"no Q4_K GGUF.*m-Q4_K_M\.gguf"):
        pick_file(HubGGUF("a/b", quant="Q4_K"), files)
    shards = ["m-Q6_K-00001-of-00002.gguf", "m-Q6_K-00002-of-00002.gguf"]
    with pytest.raises(ModelFetchError, match=r"split into 2 files.*--merge"):
        pick_file(HubGGUF("a/b", quant="Q6_K"), shards)


def test_a_fetch_by_quantization_lands_the_exact_file_and_is_found_offline(
    hub, model_bytes, tmp_path
):
    ref = HubGGUF(REPO, quant="Q4_K_M")
    assert cached_gguf(ref, cache_dir=tmp_path) is None
    path = fetch_gguf(ref, endpoint=hub.endpoint, cache_dir=tmp_path)
    assert path.name == FILE
    assert path.read_bytes() == model_bytes
    hub.stop()  # later starts need no network
    assert cached_gguf(ref, cache_dir=tmp_path) == path
    assert cached_gguf(HubGGUF(REPO, filename=FILE), cache_dir=tmp_path) == path


def test_a_dropped_connection_resumes_where_it_broke_off(hub, model_bytes, tmp_path, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub keeps what it has read in whole chunks (10 MiB); this file is smaller
    chunk = 64 << 10
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", chunk)
    hub.cut_at, hub.cuts_left = len(model_bytes) // 3, 1
    path = fetch_gguf(HubGGUF(REPO, filename=FILE), endpoint=hub.endpoint, cache_dir=tmp_path)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(model_bytes).digest()
    gets = [r for r in hub.requests if r[0] == "GET" and FILE in r[1]]
    resumed_at = hub.cut_at // chunk * chunk
    assert resumed_at > 0
    assert [r[2] for r in gets] == [None, f"bytes={resumed_at}-"]


def test_a_download_that_keeps_breaking_leaves_nothing_half_written(hub, model_bytes, tmp_path):
    hub.cut_at = len(model_bytes) // 2  # every request stops there
    with pytest.raises(ModelFetchError, match=r"download failed.*models fetch"):
        fetch_gguf(HubGGUF(REPO, filename=FILE), endpoint=hub.endpoint, cache_dir=tmp_path)
    assert [f for f in _cache_files(tmp_path) if "blobs" in f or "snapshots" in f] == []
    assert cached_gguf(HubGGUF(REPO, filename=FILE), cache_dir=tmp_path) is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cut.gguf", r"blk\.\d+\.\S+ .*runs past the end"),
        ("junk.gguf", "not a GGUF file"),
        ("q2k.gguf", r"blk\.0\.attn_v\.weight: tensor type Q2_K .*supported.*Q4_K"),
        ("mamba.gguf", r"unsupported GGUF architecture 'mamba'.*llama, mistral, qwen2"),
    ],
)
def test_a_file_the_engine_cannot_run_is_refused_and_taken_out_of_the_cache(
    hub, model_bytes, tmp_path, name, expected
):
    hub.repos[REPO][name] = _bad_file(name, model_bytes, tmp_path)
    ref = HubGGUF(REPO, filename=name)
    with pytest.raises(ModelFetchError, match=expected):
        fetch_gguf(ref, endpoint=hub.endpoint, cache_dir=tmp_path / "cache")
    assert cached_gguf(ref, cache_dir=tmp_path / "cache") is None
    assert [f for f in _cache_files(tmp_path / "cache") if "blobs" in f] == []


def _bad_file(name: str, model_bytes: bytes, tmp_path: Path) -> bytes:
    if name == "cut.gguf":
        return model_bytes[: len(model_bytes) - 5000]
    if name == "junk.gguf":
        return b"<html>rate limited</html>"
    path = tmp_path / name
    if name == "q2k.gguf":
        write_qwen2_gguf(str(path), v_type="Q2_K")
    else:
        w = gguf.GGUFWriter(str(path), "mamba")
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path.read_bytes()


def test_bytes_that_differ_from_the_hubs_sha256_are_refused(hub, model_bytes, tmp_path):
    original = hub.serve

    def corrupt(h, body):  # the etag is the true file's; one byte changes on the way
        data = hub.repos[REPO][FILE]
        hub.repos[REPO][FILE] = data if not body else data[:-1] + bytes([data[-1] ^ 1])
        try:
            original(h, body)
        finally:
            hub.repos[REPO][FILE] = data

    hub.serve = corrupt
    with pytest.raises(ModelFetchError, match="sha256"):
        fetch_gguf(HubGGUF(REPO, filename=FILE), endpoint=hub.endpoint, cache_dir=tmp_path)
    assert cached_gguf(HubGGUF(REPO, filename=FILE), cache_dir=tmp_path) is None


def test_a_missing_repo_or_file_is_named(hub, tmp_path):
    with pytest.raises(ModelFetchError, match="no model repository acme/Nope"):
        fetch_gguf(HubGGUF("acme/Nope", quant="Q4_K_M"), endpoint=hub.endpoint, cache_dir=tmp_path)
    with pytest.raises(ModelFetchError, match=r"has no file other.gguf"):
        fetch_gguf(HubGGUF(REPO, filename="other.gguf"), endpoint=hub.endpoint, cache_dir=tmp_path)
    with pytest.raises(ModelFetchError, match="no Q5_K_M GGUF"):
        fetch_gguf(HubGGUF(REPO, quant="Q5_K_M"), endpoint=hub.endpoint, cache_dir=tmp_path)


def test_an_unreachable_hub_is_said_at_once(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with pytest.raises(ModelFetchError, match=r"not in the local cache.*not reachable"):
        fetch_gguf(HubGGUF(REPO, quant="Q4_K_M"), endpoint="http://127.0.0.1:9", cache_dir=tmp_path)


def test_the_service_fetches_at_first_start_and_reads_the_cache_after(
    hub, model_bytes, tmp_path, monkeypatch
):
    from huggingface_hub import constants

    from prefixrag.app.core.settings import Settings
    from prefixrag.app.services.llm import engine_config_from_settings
    from prefixrag.engine.config import EngineConfig
    from prefixrag.engine.model_runner import ModelRunner

    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    settings = Settings(llm=f"hf.co/{REPO}", data_dir=tmp_path / "data")
    first = engine_config_from_settings(settings).model
    assert Path(first).read_bytes() == model_bytes
    hub.stop()
    assert engine_config_from_settings(settings).model == first
    runner = ModelRunner(EngineConfig(model=str(first), num_kv_blocks=4, kv_cache_dtype="float32"))
    assert runner.model_config.architecture == "qwen2"


_RUN_CLI = "from prefixrag.app.cli.main import main; exit(main())"


def test_models_fetch_on_the_command_line(hub, model_bytes, tmp_path):
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.endpoint,
        "HF_HOME": str(tmp_path / "hf"),
        "PREFIXRAG_LLM": f"{REPO}:Q4_K_M",
        "PREFIXRAG_DATA_DIR": str(tmp_path / "data"),
    }
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", _RUN_CLI, "models", "fetch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert f"llm: {REPO}:Q4_K_M is in " in done.stdout, done.stdout + done.stderr
    landed = next((tmp_path / "hf" / "hub").rglob(FILE))
    assert landed.read_bytes() == model_bytes
    assert not list((tmp_path / "hf").rglob("*.incomplete"))
