"""A GGUF file's weights, mapped read-only: its matmul tensors stay in the file's own blocks.

gguf-py maps the file once; every tensor is a view (offset, type, shape) into the map, checked
against the file's size before use. By type:
- Q4_K and Q6_K (a Q4_K_M file's matrices): the file's own rows, read where they lie;
- Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q5_K: split once into the kernel's planes (a copy of about the
  file's bytes, never a float32 one);
- F32, F16, BF16: widened to float32 (norms and biases; the matrices of an unquantized file);
- any other type is refused, naming the tensor.
Nothing is written to disk. The config comes from the file's metadata.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from prefixrag.engine.model_config import ModelConfig
from prefixrag.engine.weights.gguf_file import GGUFFile, TensorInfo, read_gguf_file
from prefixrag.engine.weights.gguf_loader import hf_name, model_config_from
from prefixrag.kernels.block_quant_matmul import KQUANT_GGUF_TYPES, MAX_K, BlockQuantWeight
from prefixrag.kernels.gguf_planes import SUPPORTED_GGUF_TYPES, from_gguf_blocks

FILE_ROW_KINDS = {gguf_type: kind for kind, gguf_type in KQUANT_GGUF_TYPES.items()}
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(slots=True)
class MappedGGUF:
    """The weights of one GGUF file under Hugging Face names: ``blocks`` for the matmuls the
    kernels read in blocks, ``dense`` float32 for the rest. ``mapped_bytes`` are read in place
    from the map; ``copied_bytes`` were made at load (planes and float32 tensors)."""

    config: ModelConfig
    blocks: dict[str, BlockQuantWeight]
    dense: dict[str, torch.Tensor]
    mapped_bytes: int
    copied_bytes: int
    file_bytes: int
    # the parsed header and the map the views point into
    file: GGUFFile = field(repr=False)


def _matrix_types() -> str:
    planes = (t for t in SUPPORTED_GGUF_TYPES if t not in FILE_ROW_KINDS)
    return ", ".join((*FILE_ROW_KINDS, *planes, *FLOAT_TYPES))


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    # the map is read-only, and no kernel writes to weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _float32(raw: np.ndarray, gguf_type: str, shape: tuple[int, ...]) -> torch.Tensor:
    if gguf_type == "BF16":  # the top half of a float32
        wide = raw.view(np.uint16).astype(np.uint32) << 16
        array = wide.view(np.float32)
    else:
        array = raw.view(np.float32 if gguf_type == "F32" else np.float16).astype(np.float32)
    return torch.from_numpy(array.reshape(shape))


def _config_of(file: GGUFFile) -> ModelConfig:
    shapes = {t.name: tuple(reversed(t.shape)) for t in file.tensors}
    return model_config_from(file.metadata, shapes, file.array_lengths.get("tokenizer.ggml.tokens"))


def _check_matrix(t: TensorInfo) -> None:
    shape, gguf_type = t.shape, t.type_name
    if (
        len(shape) != 2
        or shape[1] > MAX_K
        or (gguf_type not in FILE_ROW_KINDS and gguf_type not in SUPPORTED_GGUF_TYPES)
    ):
        raise ValueError(
            f"{t.name}: tensor type {gguf_type} of shape {shape} is not supported; the "
            f"engine runs matrices of {_matrix_types()} with rows up to {MAX_K} wide"
        )


def check_gguf(path: str | Path) -> ModelConfig:
    """What :func:`map_gguf` would refuse in ``path``, found from its header alone (no tensor
    byte is read): a file that is not a GGUF, one cut short, an architecture, tensor name or
    tensor type the engine does not run. Returns the model's config."""
    file = read_gguf_file(path)
    config = _config_of(file)
    for t in file.tensors:
        hf_name(t.name)
        if t.type_name not in FLOAT_TYPES:
            _check_matrix(t)
    return config


def map_gguf(path: str | Path) -> MappedGGUF:
    """Map ``path`` and build its weights (see the module doc); ValueError for a file the engine
    cannot run, naming the tensor, its type and what is supported."""
    file = read_gguf_file(path)
    config = _config_of(file)
    blocks: dict[str, BlockQuantWeight] = {}
    dense: dict[str, torch.Tensor] = {}
    mapped = copied = 0
    for t in file.tensors:
        name, gguf_type, shape = hf_name(t.name), t.type_name, t.shape
        raw = file.tensor_bytes(t)
        if gguf_type in FLOAT_TYPES:
            dense[name] = _float32(raw, gguf_type, shape)
            copied += dense[name].numel() * 4
            continue
        _check_matrix(t)
        if gguf_type in FILE_ROW_KINDS:
            codes = _as_tensor(raw.reshape(shape[0], -1))
            blocks[name] = BlockQuantWeight(FILE_ROW_KINDS[gguf_type], codes, None, None)
            mapped += blocks[name].nbytes
        else:
            blocks[name] = from_gguf_blocks(raw, gguf_type, shape)  # type: ignore[arg-type]
            copied += blocks[name].nbytes
    return MappedGGUF(config, blocks, dense, mapped, copied, file.data.size, file)
