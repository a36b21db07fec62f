"""A minimal, fast GGUF reader: metadata and memory-mapped tensor data.

gguf.GGUFReader builds numpy views for every element of every metadata array (the 49k-token
vocabulary and 49k merges of SmolLM2 take ~4.5 s); this reader parses the same file format in
~0.1 s. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value type -> struct format of a scalar (also the numpy dtype of an array of them)
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    # Memory-mapped, in torch order ([rows (out), ..., cols (in)]: GGUF dims reversed): float arrays
    # for F32/F16/F64, uint8 [rows, row_bytes] otherwise.
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, object]  # scalars as Python values, strings as str, arrays as list / np.ndarray
    tensors: list[GGUFTensorInfo]


class _Cursor:
    def __init__(self, buffer: np.ndarray):
        self.buffer = buffer
        self.bytes = memoryview(buffer)
        self.offset = 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.bytes, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        value = bytes(self.bytes[self.offset : self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return value

    def value(self, value_type: int):
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type = self.scalar("<I")
            count = self.scalar("<Q")
            if element_type == _STRING:
                return [self.string() for _ in range(count)]
            if element_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALAR_FORMATS[element_type])
            array = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset)
            self.offset += count * dtype.itemsize
            return array
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header and metadata; tensor data stays memory-mapped (read on first access)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer)
    if bytes(cursor.bytes[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic) (fix: pass a .gguf file; this one is of another "
                         "format, or damaged)")
    cursor.offset = 4
    version = cursor.scalar("<I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (need >= 2)")
    tensor_count = cursor.scalar("<Q")
    kv_count = cursor.scalar("<Q")
    metadata: dict[str, object] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("<I"))
    raw_infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
        raw_infos.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))  # + type, offset
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.offset // alignment) * alignment
    float_types = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                   GGMLQuantizationType.F64: np.float64}
    tensors = []
    for name, dims, ggml_type, offset in raw_infos:
        shape = tuple(reversed(dims))
        start = data_start + offset
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        row_bytes = shape[-1] // block_size * type_size
        data = buffer[start : start + int(np.prod(shape[:-1])) * row_bytes].reshape(*shape[:-1], row_bytes)
        if ggml_type in float_types:
            data = data.view(float_types[ggml_type])
        tensors.append(GGUFTensorInfo(name, ggml_type, data))
    return GGUFFile(metadata, tensors)
