"""A GGUF file's header, read in a fraction of a second.

The `gguf` package's reader builds a numpy view per element of every metadata array (Qwen's
151k-token vocabulary and its merges: 7-11 s a file on the 2-core CPUs, and transformers
builds one per tokenizer, config and weights). Transformers' own fast reader stops at the
first block type it cannot dequantize (Q5_0, which Q4_K_M files use). This reads only what a
load needs: the scalar metadata, the tensor table, and the byte span of every metadata entry
(so an identical tokenizer in two files can be recognised by hashing its bytes). Block sizes
come from the `gguf` package's table, so every type it knows has a size here.
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING = int(gguf.GGUFValueType.STRING)
_ARRAY = int(gguf.GGUFValueType.ARRAY)
_SCALAR_FORMATS = {
    int(gguf.GGUFValueType.UINT8): "<B",
    int(gguf.GGUFValueType.INT8): "<b",
    int(gguf.GGUFValueType.UINT16): "<H",
    int(gguf.GGUFValueType.INT16): "<h",
    int(gguf.GGUFValueType.UINT32): "<I",
    int(gguf.GGUFValueType.INT32): "<i",
    int(gguf.GGUFValueType.FLOAT32): "<f",
    int(gguf.GGUFValueType.BOOL): "<?",
    int(gguf.GGUFValueType.UINT64): "<Q",
    int(gguf.GGUFValueType.INT64): "<q",
    int(gguf.GGUFValueType.FLOAT64): "<d",
}


class GgufFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores the fastest-moving dimension first)
    ggml_type: int
    start: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # scalars and strings; an array as its element count
    spans: dict[str, tuple[int, int]]  # each metadata entry's bytes in the file, [start, end)
    tensors: tuple[GgufTensor, ...]
    arrays: frozenset[str] = frozenset()  # the metadata keys whose value is an array

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def digest(self, prefix: str) -> str:
        """A hash of the bytes of every metadata entry whose key starts with ``prefix``:
        two files with the same digest for "tokenizer." describe the same tokenizer."""
        sha = hashlib.sha256()
        with open(self.path, "rb") as handle:
            for key in sorted(self.spans):
                if key.startswith(prefix):
                    start, end = self.spans[key]
                    handle.seek(start)
                    sha.update(handle.read(end - start))
        return sha.hexdigest()


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def skip(self, length: int) -> None:
        if length > len(self.data) - self.pos:
            raise GgufFormatError(f"a header entry at byte {self.pos} runs past the end of the file")
        self.pos += length

    def string(self) -> str:
        length = self.unpack("<Q")
        start = self.pos
        self.skip(length)
        return bytes(self.data[start : self.pos]).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.skip(self.unpack("<Q"))

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type, count = self.unpack("<IQ")
            if element_type in _SCALAR_FORMATS:
                self.skip(count * struct.calcsize(_SCALAR_FORMATS[element_type]))
            elif element_type == _STRING:
                for _ in range(count):
                    self.skip_string()
            else:  # arrays of arrays: walk them
                for _ in range(count):
                    self.value(element_type)
            return count
        raise GgufFormatError(f"unknown metadata value type {value_type} at byte {self.pos}")


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    try:
        block_elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GgufFormatError(
            f"unknown ggml tensor type {ggml_type} (newer than the installed gguf package?)"
        ) from None
    return math.prod(shape) // block_elements * block_bytes


def read_header(path: Path | str) -> GgufHeader:
    """Parse ``path``'s metadata and tensor table. Raises GgufFormatError (a ValueError).

    A first load reads a file's header for its tokenizer, its config and its weights: it is
    parsed once per process while the file keeps its size and modification time."""
    path = Path(path)
    stat = path.stat()
    return _read_header(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_header(path: Path, size: int, mtime_ns: int) -> GgufHeader:
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        try:
            if bytes(data[:4]) != _MAGIC:
                raise GgufFormatError(f"{path.name} does not start with the GGUF magic bytes")
            cursor.pos = 4
            version, tensor_count, metadata_count = cursor.unpack("<IQQ")
            if version not in _VERSIONS:
                raise GgufFormatError(f"{path.name} is GGUF version {version}; this reader knows versions 2 and 3")
            metadata: dict[str, Any] = {}
            spans: dict[str, tuple[int, int]] = {}
            arrays = set()
            for _ in range(metadata_count):
                key = cursor.string()
                start = cursor.pos
                value_type = cursor.unpack("<I")
                metadata[key] = cursor.value(value_type)
                spans[key] = (start, cursor.pos)
                if value_type == _ARRAY:
                    arrays.add(key)
            table = []
            for _ in range(tensor_count):
                name = cursor.string()
                dims = cursor.unpack("<I")
                shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", data, cursor.pos)))
                cursor.pos += 8 * dims
                ggml_type, offset = cursor.unpack("<IQ")
                table.append((name, shape, ggml_type, offset))
        except struct.error as exc:
            raise GgufFormatError(f"{path.name} ends inside its header ({exc})") from None
        alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        data_start = (cursor.pos + alignment - 1) // alignment * alignment
        tensors = []
        for name, shape, ggml_type, offset in table:
            tensor = GgufTensor(name, shape, ggml_type, data_start + offset, tensor_nbytes(ggml_type, shape))
            if tensor.start + tensor.nbytes > len(data):
                raise GgufFormatError(f"{path.name} is truncated: tensor {name} ends past the end of the file")
            tensors.append(tensor)
    return GgufHeader(path, version, metadata, spans, tuple(tensors), frozenset(arrays))
