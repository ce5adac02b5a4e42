"""A GGUF file's header read lean: its metadata, its tensors' places, and one read-only map.

gguf-py's reader makes numpy objects for every element of every array field, and a tokenizer's
arrays hold hundreds of thousands of strings: for Qwen2.5's 151k-token vocabulary it took 15 s
and 160 MiB before a weight was touched. Here large arrays are stepped over (their length kept)
and each tensor is an offset into the map, checked against the file's size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np

# value types of the GGUF format: struct codes of the scalars, 8 string, 9 array
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# arrays longer than this are stepped over, their length kept (the vocabulary and merges; the
# tokenizer reads them itself)
MAX_ARRAY_KEPT = 4096
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor's name, shape (rows first, as numpy has it), GGML type, and its bytes' place."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    nbytes: int


@dataclass(slots=True)
class GGUFFile:
    """A parsed header (``metadata``; ``array_lengths`` for the arrays stepped over), the
    tensors, and ``data``, the whole file mapped read-only as uint8."""

    path: Path
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: list[TensorInfo]
    data: np.memmap

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes: a view into the map."""
        return self.data[t.offset : t.offset + t.nbytes]


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        raw = self.f.read(size)
        if len(raw) != size:
            raise ValueError("the header ends early")
        return struct.unpack("<" + fmt, raw)[0]

    def string(self) -> str:
        n = self.unpack("Q")
        raw = self.f.read(n)
        if len(raw) != n:
            raise ValueError("the header ends early")
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.f.seek(self.unpack("Q"), 1)

    def value(self, kind: int, key: str, lengths: dict[str, int]) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"metadata {key!r} has an unknown value type {kind}")
        item, count = self.unpack("I"), self.unpack("Q")
        if count > MAX_ARRAY_KEPT:
            lengths[key] = count
            self._skip_array(item, count, key)
            return None
        return [self.value(item, key, lengths) for _ in range(count)]

    def _skip_array(self, item: int, count: int, key: str) -> None:
        if item in _SCALARS:
            self.f.seek(struct.calcsize("<" + _SCALARS[item]) * count, 1)
        elif item == _STRING:
            for _ in range(count):
                self.skip_string()
        else:
            raise ValueError(f"metadata {key!r}: a long array of type {item} is not supported")


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header and map it; ValueError, naming the file (and the tensor), for one
    that is not a GGUF or whose tensors run past its end."""
    source = Path(path)
    size = source.stat().st_size
    with source.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{source} is not a GGUF file (no GGUF magic at its start)")
        r = _Reader(f)
        try:
            version = r.unpack("I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (2 and 3 are read)")
            num_tensors, num_kv = r.unpack("Q"), r.unpack("Q")
            metadata: dict[str, Any] = {}
            lengths: dict[str, int] = {}
            for _ in range(num_kv):
                key = r.string()
                value = r.value(r.unpack("I"), key, lengths)
                if key not in lengths:
                    metadata[key] = value
            infos = [_tensor_info(r) for _ in range(num_tensors)]
        except (ValueError, struct.error, UnicodeDecodeError) as err:
            raise ValueError(f"{source} is not a readable GGUF file: {err}") from err
        align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-f.tell() // align) * align
    tensors = []
    for name, shape, type_name, offset, nbytes in infos:
        t = TensorInfo(name, shape, type_name, start + offset, nbytes)
        if t.offset + t.nbytes > size:
            raise ValueError(
                f"{source}: tensor {name} ({type_name}, {nbytes} bytes at offset {t.offset}) "
                f"runs past the end of the {size}-byte file: truncated?"
            )
        tensors.append(t)
    data = np.memmap(source, dtype=np.uint8, mode="r")
    return GGUFFile(source, metadata, lengths, tensors, data)


def _tensor_info(r: _Reader) -> tuple[str, tuple[int, ...], str, int, int]:
    name = r.string()
    dims = [r.unpack("Q") for _ in range(r.unpack("I"))]
    type_id, offset = r.unpack("I"), r.unpack("Q")
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"tensor {name} has an unknown type id {type_id}") from None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    count = int(np.prod(dims)) if dims else 1
    if dims and dims[0] % block:
        raise ValueError(f"tensor {name}: a row of {dims[0]} is not whole {qtype.name} blocks")
    # GGUF lists dims innermost first
    return name, tuple(reversed(dims)), qtype.name, offset, count // block * type_size
