"""DiskTier: chunk KV files verify on every read, survive restarts and kills, and stay in budget."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from prefixrag.engine.chunks import disk_tier
from prefixrag.engine.chunks.disk_tier import DiskTier

FP = {"model": "tiny", "dtype": "float32", "block_size": 16, "num_layers": 2, "head_dim": 8}
NS = "tenant-a"
TOKENS = (5, 6, 7, 8)
LOGGER = "prefixrag.engine.chunks.disk_tier"


def _kv(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, len(TOKENS), 2, 8, generator=gen).to(dtype)
    v = torch.randn(2, len(TOKENS), 2, 8, generator=gen).to(dtype)
    return k, v


def _key(n: int) -> bytes:
    return bytes([n]) * 16


def _tier(root: Path, **kwargs) -> DiskTier:
    kwargs.setdefault("fingerprint", FP)
    kwargs.setdefault("max_bytes", 1 << 20)
    kwargs.setdefault("background", False)
    return DiskTier(root, **kwargs)


def _put(tier: DiskTier, n: int, namespace: str = NS, tags: tuple[str, ...] = ("doc:1",)) -> None:
    k, v = _kv(seed=n)
    tier.put(_key(n), namespace, TOKENS, 100 + n, tags, k, v)


def _warned(caplog: pytest.LogCaptureFixture) -> bool:
    return any(r.levelno == logging.WARNING and r.name == LOGGER for r in caplog.records)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_survives_restart(tmp_path: Path, dtype: torch.dtype) -> None:
    k, v = _kv(dtype)
    tier = _tier(tmp_path)
    tier.put(_key(1), NS, TOKENS, 42, ("doc:1", "doc:2"), k, v)
    for reopened in (tier, _tier(tmp_path)):
        assert reopened.contains(_key(1))
        got = reopened.get(_key(1), NS, list(TOKENS))
        assert got is not None
        base_pos, k2, v2, tags = got
        assert (base_pos, tags) == (42, ("doc:1", "doc:2"))
        assert k2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)
        k2.zero_()  # the returned tensors are the caller's own
        assert torch.equal(v2, v)
    assert tier.stats()["hits"] == 1 and tier.stats()["writes"] == 1


@pytest.mark.parametrize("change", [{"block_size": 32}, {"dtype": "bfloat16"}])
def test_other_fingerprint_never_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict
) -> None:
    ours = _tier(tmp_path)
    _put(ours, 1)
    theirs = _tier(tmp_path, fingerprint={**FP, **change})
    assert theirs.path != ours.path
    assert not theirs.contains(_key(1)) and theirs.get(_key(1), NS, TOKENS) is None
    assert ours.contains(_key(1)) and ours._file(_key(1)).exists()
    # a file that lands in the wrong directory anyway is deleted when the index is built
    (theirs.path / ours._file(_key(1)).name).write_bytes(ours._file(_key(1)).read_bytes())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        theirs = _tier(tmp_path, fingerprint={**FP, **change})
    assert theirs.num_files == 0 and theirs.corrupt == 1 and _warned(caplog)
    assert not any(theirs.path.iterdir())


def test_wrong_owner_is_a_miss_that_keeps_the_file(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    _put(tier, 1)
    assert tier.get(_key(1), "tenant-b", TOKENS) is None
    assert tier.get(_key(1), NS, (5, 6, 7, 9)) is None
    assert tier._file(_key(1)).exists() and tier.get(_key(1), NS, TOKENS) is not None
    assert tier.stats() | {"bytes": 0} == {
        "num_files": 1,
        "bytes": 0,
        "writes": 1,
        "dropped_writes": 0,
        "hits": 1,
        "misses": 2,
        "corrupt": 0,
    }


def _payload_offset(data: bytes) -> int:
    return 12 + int.from_bytes(data[8:12], "little")


@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.parametrize("damage", ["payload_byte", "truncate", "garble_header", "trailer"])
def test_corrupt_file_is_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, restart: bool
) -> None:
    tier = _tier(tmp_path)
    _put(tier, 1)
    _put(tier, 2)
    path = tier._file(_key(1))
    data = bytearray(path.read_bytes())
    if damage == "payload_byte":
        data[_payload_offset(data) + 5] ^= 0x01
    elif damage == "truncate":
        del data[-40:]
    elif damage == "garble_header":
        data[20:24] = b"\xff\x00{}"
    else:
        data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        if restart:
            tier = _tier(tmp_path)
        assert tier.get(_key(1), NS, TOKENS) is None
    assert _warned(caplog) and not path.exists() and not tier.contains(_key(1))
    assert tier.corrupt == 1
    assert tier.get(_key(2), NS, TOKENS) is not None  # the neighbour is untouched


# A child that rewrites one big entry, stalling in the middle of the payload on round 2.
_KILLED_WRITER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import torch
    from prefixrag.engine.chunks import disk_tier

    root, fingerprint = Path(sys.argv[1]), json.loads(sys.argv[2])
    state = {"round": 0, "pieces": 0}

    def stall():
        state["pieces"] += 1
        if state["round"] == 2 and state["pieces"] == 100:
            print("MID", flush=True)
            time.sleep(120)

    disk_tier._PIECE_BYTES = 4096
    disk_tier._piece_hook = stall
    tier = disk_tier.DiskTier(root, fingerprint=fingerprint, max_bytes=1 << 30, background=False)
    for i in range(3):
        state["round"], state["pieces"] = i, 0
        k = torch.full((2, 256, 4, 64), float(i))
        tier.put(bytes(16), "ns", range(256), i, ("doc:1",), k, -k)
        print("DONE", i, flush=True)
    """
)


@pytest.mark.timeout(120)
def test_kill_during_write_leaves_the_last_complete_entry(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path), json.dumps(FP)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if lines[-1] == "MID":
                break
        assert lines == ["DONE 0", "DONE 1", "MID"]
        proc.kill()  # SIGKILL
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    directory = tmp_path / disk_tier.fingerprint_id(FP)
    assert any(name.endswith(".tmp") for name in os.listdir(directory))  # it died mid-write

    tier = _tier(tmp_path, max_bytes=1 << 30)
    assert not any(name.endswith(".tmp") for name in os.listdir(directory))
    got = tier.get(bytes(16), "ns", range(256))
    assert got is not None and tier.corrupt == 0
    base_pos, k, v, tags = got
    assert base_pos == 1 and tags == ("doc:1",)
    assert torch.equal(k, torch.full((2, 256, 4, 64), 1.0)) and torch.equal(v, -k)


def test_eviction_drops_least_recently_used(tmp_path: Path) -> None:
    probe = _tier(tmp_path / "probe")
    _put(probe, 1)
    size = probe.num_bytes
    tier = _tier(tmp_path, max_bytes=2 * size + size // 2)
    _put(tier, 1)
    _put(tier, 2)
    assert tier.get(_key(1), NS, TOKENS) is not None  # 2 is now the least recently used
    _put(tier, 3)
    assert [tier.contains(_key(n)) for n in (1, 2, 3)] == [True, False, True]
    assert not tier._file(_key(2)).exists()
    assert tier.num_bytes == 2 * size and tier.num_files == 2


def test_restart_orders_recency_by_mtime(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for n in (1, 2, 3):
        _put(tier, n)
    size = tier.num_bytes // 3
    for n, age in ((1, 10), (2, 30), (3, 20)):
        stamp = time.time() - age
        os.utime(tier._file(_key(n)), (stamp, stamp))
    smaller = _tier(tmp_path, max_bytes=2 * size)
    assert [smaller.contains(_key(n)) for n in (1, 2, 3)] == [True, False, True]


def test_drop_tag_removes_only_that_namespace_and_tag(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    _put(tier, 1, tags=("doc:1",))
    _put(tier, 2, tags=("doc:1", "doc:2"))
    _put(tier, 3, tags=("doc:2",))
    _put(tier, 4, namespace="tenant-b", tags=("doc:1",))
    assert tier.drop_tag(NS, "doc:1") == 2
    assert [tier.contains(_key(n)) for n in (1, 2, 3, 4)] == [False, False, True, True]
    assert _tier(tmp_path).num_files == 2  # the files are gone, not just unindexed


@pytest.fixture
def stalled_writer(monkeypatch: pytest.MonkeyPatch):
    """Makes the writer thread wait inside its first payload piece until the event is set."""
    release = threading.Event()
    monkeypatch.setattr(disk_tier, "_piece_hook", lambda: release.wait(10))
    yield release
    release.set()


def test_background_put_copies_and_flush_waits(tmp_path: Path) -> None:
    tier = _tier(tmp_path, background=True)
    k, v = _kv()
    expected = k.clone()
    tier.put(_key(1), NS, TOKENS, 7, (), k, v)
    k.zero_()  # the tier took its own copy
    tier.flush()
    got = tier.get(_key(1), NS, TOKENS)
    assert got is not None and torch.equal(got[1], expected)
    tier.close()
    _put(tier, 2)
    assert tier.dropped_writes == 1 and not tier.contains(_key(2))


def test_full_queue_drops_instead_of_blocking(tmp_path: Path, stalled_writer) -> None:
    tier = _tier(tmp_path, background=True, max_queue_bytes=1)
    _put(tier, 1)  # an empty queue takes any entry; the writer stalls on it
    started = time.monotonic()
    _put(tier, 2)
    assert time.monotonic() - started < 1.0
    assert tier.dropped_writes == 1
    stalled_writer.set()
    tier.flush()
    assert tier.contains(_key(1)) and not tier.contains(_key(2))
    assert tier.stats()["writes"] == 1
    tier.close()


def test_discard_and_drop_tag_cancel_queued_writes(tmp_path: Path, stalled_writer) -> None:
    tier = _tier(tmp_path, background=True)
    _put(tier, 1, tags=("doc:1",))
    _put(tier, 2, tags=("doc:2",))
    _put(tier, 3, tags=("doc:3",))
    assert tier.drop_tag(NS, "doc:1") == 0  # nothing on disk yet, but the writes are cancelled
    tier.discard(_key(2))
    stalled_writer.set()
    tier.flush()
    assert [tier.contains(_key(n)) for n in (1, 2, 3)] == [False, False, True]
    assert sorted(p.name for p in tier.path.iterdir()) == [tier._file(_key(3)).name]
    tier.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"token_ids": (1, 2, 3)},
        {"v": torch.zeros(2, 4, 2, 8, dtype=torch.float16)},
        {"key": b""},
        {"base_pos": -1},
    ],
)
def test_put_rejects_malformed_entries(tmp_path: Path, bad: dict) -> None:
    k, v = _kv()
    args = {"key": _key(1), "namespace": NS, "token_ids": TOKENS, "base_pos": 0, "tags": ()}
    args |= {"k": k, "v": v} | bad
    with pytest.raises(ValueError):
        _tier(tmp_path).put(**args)
