"""Fast GGUF header parsing, shared by the weight loader and the tokenizer, cached per process.

`gguf.GGUFReader` builds one numpy view per value it parses, which makes a 49k-token vocabulary
(tokens, merges, scores, token types) cost seconds. `read_gguf_header` walks the same layout
with `struct` over a read-only memory map, reads numeric arrays in bulk with numpy, and decodes
each string exactly once. The parsed header (metadata values and tensor directory, no file
handle) is kept in a small per-process cache keyed by path, size, mtime and inode, so the model
loader and `Tokenizer.from_gguf` parse a file once between them.

GGUF layout (v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 kv count, then kv pairs
(string key, u32 value type, value), then tensor infos (string name, u32 n_dims, u64 dims[n],
u32 ggml type, u64 offset), then tensor data from the next multiple of `general.alignment`.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

__all__ = [
    "GGUFFormatError",
    "GGUFHeader",
    "GGUFTensorEntry",
    "clear_gguf_header_cache",
    "read_gguf_header",
]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_CACHE_SIZE = 4

# Fixed-size scalar value types: (struct code, numpy dtype code).
_SCALARS: dict[int, tuple[str, str]] = {
    GGUFValueType.UINT8: ("B", "u1"),
    GGUFValueType.INT8: ("b", "i1"),
    GGUFValueType.UINT16: ("H", "u2"),
    GGUFValueType.INT16: ("h", "i2"),
    GGUFValueType.UINT32: ("I", "u4"),
    GGUFValueType.INT32: ("i", "i4"),
    GGUFValueType.FLOAT32: ("f", "f4"),
    GGUFValueType.UINT64: ("Q", "u8"),
    GGUFValueType.INT64: ("q", "i8"),
    GGUFValueType.FLOAT64: ("d", "f8"),
    GGUFValueType.BOOL: ("?", "u1"),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this parser understands; the message says why (no path in it)."""


@dataclass(frozen=True)
class GGUFTensorEntry:
    """One entry of the tensor directory: name, GGML type, GGUF dims (`ne`, fastest first), bytes."""

    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Everything in a GGUF file except the tensor data.

    `fields` maps each metadata key to `(value_type, element_type, value)`: element_type is the
    array's element type (None for scalars); strings are decoded UTF-8 (invalid bytes replaced),
    bools are bools, floats are Python floats of the stored float32/float64, arrays are tuples
    (nested arrays: tuples of tuples). The cache shares one header between callers, so nothing
    in it is mutable; `value()` hands out lists.
    """

    path: Path
    file_size: int
    version: int
    byte_order: str  # "<" or ">" (a big-endian GGUF)
    alignment: int
    data_offset: int
    fields: dict[str, tuple[GGUFValueType, GGUFValueType | None, Any]]
    tensors: tuple[GGUFTensorEntry, ...]

    def value(self, key: str, default: Any = None) -> Any:
        """The value of `key` (arrays as lists, nested arrays as lists of lists), or `default`."""
        entry = self.fields.get(key)
        if entry is None:
            return default
        return _thaw(entry[2])

    def value_type(self, key: str) -> GGUFValueType | None:
        """The GGUF value type of `key`, None when absent."""
        entry = self.fields.get(key)
        return None if entry is None else entry[0]


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        if value and isinstance(value[0], tuple):
            return [_thaw(v) for v in value]
        return list(value)
    return value


class _Parser:
    """Sequential reader over the mapped file; every read is bounds-checked."""

    def __init__(self, buf: Any, size: int, order: str) -> None:
        self.buf = buf
        self.size = size
        self.order = order
        self.off = 0
        self._structs: dict[str, struct.Struct] = {}

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.off + n > self.size:
            raise GGUFFormatError(
                f"truncated or corrupt GGUF file ({what} at byte {self.off} needs {n} bytes, file has {self.size})"
            )

    def scalar(self, code: str, what: str) -> Any:
        st = self._structs.get(code)
        if st is None:
            st = self._structs[code] = struct.Struct(self.order + code)
        self._need(st.size, what)
        (value,) = st.unpack_from(self.buf, self.off)
        self.off += st.size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self._need(n, what)
        start = self.off
        self.off += n
        return str(self.buf[start : self.off], "utf-8", "replace")

    def string_array(self, count: int, what: str) -> tuple[str, ...]:
        # Each string needs at least its 8-byte length: reject absurd counts before looping.
        self._need(count * 8, what)
        buf, size, off = self.buf, self.size, self.off
        unpack = struct.Struct(self.order + "Q").unpack_from
        out: list[str] = [""] * count
        for i in range(count):
            (n,) = unpack(buf, off)
            off += 8
            end = off + n
            if end > size:
                self.off = off
                self._need(n, what)
            out[i] = str(buf[off:end], "utf-8", "replace")
            off = end
        self.off = off
        return tuple(out)

    def numeric_array(self, vtype: int, count: int, what: str) -> tuple[Any, ...]:
        code = _SCALARS[vtype][1]
        dtype = np.dtype(code).newbyteorder(self.order)
        self._need(count * dtype.itemsize, what)
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.off)
        self.off += count * dtype.itemsize
        values = arr.tolist()
        del arr  # release the buffer export so the map can be closed
        if vtype == GGUFValueType.BOOL:
            return tuple(bool(v) for v in values)
        return tuple(values)

    def value(self, vtype: int, what: str) -> tuple[GGUFValueType, GGUFValueType | None, Any]:
        gtype = _value_type(vtype, what)
        if gtype == GGUFValueType.STRING:
            return gtype, None, self.string(what)
        if gtype in _SCALARS:
            value = self.scalar(_SCALARS[gtype][0], what)
            return gtype, None, bool(value) if gtype == GGUFValueType.BOOL else value
        # ARRAY: u32 element type, u64 count, elements.
        etype = _value_type(self.scalar("I", what), what)
        count = self.scalar("Q", what)
        if etype == GGUFValueType.STRING:
            return gtype, etype, self.string_array(count, what)
        if etype in _SCALARS:
            return gtype, etype, self.numeric_array(etype, count, what)
        self._need(count * 12, what)  # each nested array has at least its type and count
        items = []
        inner: GGUFValueType | None = None
        for _ in range(count):
            _, inner, v = self.value(etype, what)
            items.append(v)
        return gtype, inner if inner is not None else etype, tuple(items)


def _value_type(raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GGUFFormatError(f"truncated or corrupt GGUF file (unknown value type {raw} in {what})") from None


def _parse(path: Path, buf: Any, size: int) -> GGUFHeader:
    if size < 4 or bytes(buf[0:4]) != _MAGIC:
        raise GGUFFormatError(f"not a GGUF file (starts with {bytes(buf[0:4])!r}, expected {_MAGIC!r})")
    p = _Parser(buf, size, "<")
    p.off = 4
    version = p.scalar("I", "version")
    if version & 0xFFFF == 0:
        # Written on a big-endian host: every number in the file is byte-swapped.
        p.order = ">"
        p._structs.clear()
        version = struct.unpack_from(">I", buf, 4)[0]
    if version not in _VERSIONS:
        raise GGUFFormatError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = p.scalar("Q", "tensor count")
    n_kv = p.scalar("Q", "metadata count")
    fields: dict[str, tuple[GGUFValueType, GGUFValueType | None, Any]] = {}
    for i in range(n_kv):
        key = p.string(f"metadata key {i}")
        if key in fields:
            raise GGUFFormatError(f"truncated or corrupt GGUF file (duplicate metadata key {key!r})")
        fields[key] = p.value(p.scalar("I", f"type of {key}"), key)
    alignment = GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        atype, _, alignment = fields["general.alignment"]
        if atype != GGUFValueType.UINT32 or alignment == 0 or alignment & (alignment - 1):
            raise GGUFFormatError(
                f"truncated or corrupt GGUF file (general.alignment must be a power-of-two u32, got {alignment!r})"
            )
    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = p.string(f"tensor info {i}")
        if name in names:
            raise GGUFFormatError(f"truncated or corrupt GGUF file (tensor {name} appears twice)")
        names.add(name)
        n_dims = p.scalar("I", name)
        if n_dims > 8:
            raise GGUFFormatError(f"truncated or corrupt GGUF file (tensor {name} has {n_dims} dims)")
        dims = tuple(p.scalar("Q", name) for _ in range(n_dims))
        raw_type = p.scalar("I", name)
        try:
            gtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"uses an unknown GGML tensor type {raw_type} (tensor {name})") from None
        infos.append((name, gtype, dims, p.scalar("Q", name)))
    data_offset = -(-p.off // alignment) * alignment
    tensors = []
    for name, gtype, dims, rel in infos:
        block, type_size = GGML_QUANT_SIZES[gtype]
        n_elems = prod(dims)
        tensors.append(GGUFTensorEntry(name, gtype, dims, data_offset + rel, n_elems * type_size // block))
    return GGUFHeader(path, size, version, p.order, alignment, data_offset, fields, tuple(tensors))


_cache: OrderedDict[tuple[str, int, int, int], GGUFHeader] = OrderedDict()
_cache_lock = threading.Lock()


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse the metadata and tensor directory of the GGUF at `path` (cached per process).

    The cache key is (absolute path, size, mtime, inode), so a rewritten file is parsed again.
    Raises OSError when the file cannot be read and GGUFFormatError when it is not a GGUF v2/v3.
    """
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    size = st.st_size
    with p.open("rb") as f:
        if size < 24:
            head = f.read()
            if head[:4] != _MAGIC:
                raise GGUFFormatError(f"not a GGUF file (starts with {head[:4]!r}, expected {_MAGIC!r})")
            raise GGUFFormatError(f"truncated GGUF file ({size} bytes, shorter than a GGUF header)")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            try:
                header = _parse(p, mm, size)
            except (struct.error, OverflowError, MemoryError) as exc:
                raise GGUFFormatError(f"truncated or corrupt GGUF file ({type(exc).__name__}: {exc})") from exc
        finally:
            mm.close()
    with _cache_lock:
        _cache[key] = header
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return header


def clear_gguf_header_cache() -> None:
    """Forget every cached header (tests, or a process that wants the memory back)."""
    with _cache_lock:
        _cache.clear()
