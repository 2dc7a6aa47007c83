"""One check of a GGUF file before anything reads it: its header parses, names an architecture, and the file is as long
as its tensor table says. A half-downloaded or half-assembled file is the likeliest bad file a user has; loaders
(transformers, the gguf package's reader) memory-map it and fail deep inside with `struct.error` or an IndexError.

The header is parsed here, not with `gguf.GGUFReader`: the reader builds arrays for every field and tensor before
anything could be said about the file, and its failures on a cut file vary with where the cut falls. This parser
reads only the header (a memory map, so the tensor data are never touched) and can say where the file ends.

Layout (GGUF v2/v3, llama.cpp's ggml/docs/gguf.md): magic "GGUF", uint32 version, uint64 tensor count, uint64
metadata count; the metadata (key string, uint32 value type, value); the tensor table (name, uint32 n_dims,
uint64 dims, uint32 ggml type, uint64 offset); padding to `general.alignment` (default 32); the tensor data, each
tensor at its offset from there. Strings are a uint64 length and UTF-8 bytes. Little-endian, or big-endian throughout.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from drafter_train.errors import ConfigError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value types: code -> struct format of a scalar (8 = string, 9 = array are read apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file's header says, checked against the file's size."""

    path: Path
    version: int
    architecture: str  # general.architecture (llama, qwen2, eagle3 ...)
    name: Optional[str]  # general.name, when the file has one
    tensor_count: int
    file_size: int  # bytes on disk
    data_end: int  # where the tensor table says the last tensor's data ends (<= file_size)
    metadata: dict[str, Any] = dataclass_field(default_factory=dict, repr=False)  # scalar and string values by key


class _Cut(Exception):
    """A read ran past the end of the file."""


class _Invalid(Exception):
    """The bytes are not a GGUF header."""


class _Truncated(Exception):
    """The header parses, but the file ends before the tensor data it describes."""

    def __init__(self, data_end: int):
        super().__init__(data_end)
        self.data_end = data_end


class _Header:
    """A cursor over the memory-mapped file that reads the header's fields in order."""

    def __init__(self, buf, size: int, endian: str):
        self.buf, self.size, self.endian, self.pos = buf, size, endian, 0

    def skip(self, count: int) -> None:
        if self.pos + count > self.size:
            raise _Cut
        self.pos += count

    def scalar(self, fmt: str):
        start = self.pos
        self.skip(struct.calcsize(fmt))
        return struct.unpack_from(self.endian + fmt, self.buf, start)[0]

    def string(self) -> str:
        length = self.scalar("Q")
        start = self.pos
        self.skip(length)
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str):
        """A metadata value: scalars and strings are returned, arrays are stepped over (returned as None)."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            if item in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[item]))
            elif item == _STRING:  # a vocabulary: 150k strings in a large model, stepped over undecoded
                for _ in range(count):  # each takes at least 8 bytes, so a garbage count ends at the file's end
                    self.skip(self.scalar("Q"))
            elif item == _ARRAY:
                for _ in range(count):
                    self.value(item, key)
            else:
                raise _Invalid(f"metadata {key!r} is an array of unknown type {item}")
            return None
        raise _Invalid(f"metadata {key!r} has unknown value type {vtype}")


def check_gguf(path: Union[str, Path], field: str) -> GGUFHeader:
    """The header of the GGUF file at `path`, or a one-line ConfigError that starts with `field` (the option that
    named the file), names the file and says what is wrong: not a GGUF, cut short inside its header or its tensor
    data, or no `general.architecture`. Reads the header only."""
    path = Path(path).expanduser()
    where = f"{field}: {path}"
    try:
        size = path.stat().st_size
    except OSError as err:
        raise ConfigError(f"{where}: {err.strerror}") from None
    if size < 4 or _magic(path) != MAGIC:
        raise ConfigError(f"{where}: not a GGUF file (it does not start with the bytes 'GGUF')")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(buf, path, size)
        except _Cut:
            raise ConfigError(f"{where}: cut short inside its header ({size:,} bytes): an incomplete download or "
                              "copy; fetch or assemble it again") from None
        except _Invalid as err:
            raise ConfigError(f"{where}: not a valid GGUF file: {err}") from None
        except _Truncated as err:
            raise ConfigError(f"{where}: cut short inside its tensor data: {size:,} bytes, but its tensor table "
                              f"ends at byte {err.data_end:,}; fetch or assemble it again") from None


def rewrite_gguf(src: Union[str, Path], dst: Union[str, Path], fields: Mapping = {}, tensors: Mapping = {},
                 drop: tuple = (), add: Mapping = {}) -> None:
    """dst = src with some metadata values (`fields`: name -> value) and tensor data (`tensors`: name -> array of
    the same shape) replaced, the names in `drop` left out and tensors appended (`add`: name -> (array, its
    gguf.GGMLQuantizationType)); everything else copied as it is. With the gguf package's reader and writer (the
    header check above does not need them)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue  # the writer writes the first two itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, fields.get(name, field.contents()), vtype, sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            data = np.ascontiguousarray(tensors.get(tensor.name, tensor.data))
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    for name, (data, raw_dtype) in add.items():
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=raw_dtype)
    save_gguf(writer)


def save_gguf(writer) -> None:
    """Write a filled gguf.GGUFWriter's file in the order the format wants: header, metadata, tensors."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def file_type(path: Union[str, Path], field: str) -> str:
    """A GGUF's weight type as its header names it (general.file_type: q4_k_m, f16 ...), "unknown" without one."""
    import gguf

    try:
        kind = gguf.LlamaFileType(check_gguf(path, field).metadata["general.file_type"])
    except (KeyError, ValueError):
        return "unknown"
    return kind.name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def vocabulary_ids(path: Union[str, Path], texts) -> dict[str, int]:
    """The ids of those of `texts` that are in the GGUF's own vocabulary (tokenizer.ggml.tokens; llama.cpp's, not a
    tokenizer's that transformers builds from it and may add tokens to), from the header alone. The file must have
    passed check_gguf."""
    wanted = {text.encode("utf-8"): text for text in texts}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        size = len(buf)
        header = _Header(buf, size, _endianness(buf, size))
        header.skip(4)
        header.scalar("I"), header.scalar("Q")
        for _ in range(header.scalar("Q")):
            key = header.string()
            vtype = header.scalar("I")
            if key != "tokenizer.ggml.tokens" or vtype != _ARRAY:
                header.value(vtype, key)
                continue
            item, count = header.scalar("I"), header.scalar("Q")
            if item != _STRING:
                return {}
            found = {}
            for index in range(count):
                length = header.scalar("Q")
                start = header.pos
                header.skip(length)
                text = wanted.get(bytes(buf[start:header.pos])) if length < 64 else None
                if text is not None:
                    found[text] = index
            return found
    return {}


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def _parse(buf, path: Path, size: int) -> GGUFHeader:
    endian = _endianness(buf, size)
    header = _Header(buf, size, endian)
    header.skip(4)
    version, tensor_count, kv_count = header.scalar("I"), header.scalar("Q"), header.scalar("Q")
    metadata = {}
    for _ in range(kv_count):
        key = header.string()
        metadata[key] = header.value(header.scalar("I"), key)
    metadata = {k: v for k, v in metadata.items() if v is not None}
    tensors = [_tensor_info(header) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise _Invalid(f"general.alignment is {alignment!r}")
    data_start = -(-header.pos // alignment) * alignment
    data_end = data_start + max((offset + nbytes for offset, nbytes in tensors), default=0)
    if data_end > size:
        raise _Truncated(data_end)
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise _Invalid("its header has no general.architecture")
    name = metadata.get("general.name")
    return GGUFHeader(path=path, version=version, architecture=architecture,
                      name=name if isinstance(name, str) else None, tensor_count=tensor_count, file_size=size,
                      data_end=data_end, metadata=metadata)


def _endianness(buf, size: int) -> str:
    """'<' or '>', from the version field (llama.cpp writes big-endian files for big-endian hosts)."""
    if size < 8:
        raise _Cut
    little, big = struct.unpack_from("<I", buf, 4)[0], struct.unpack_from(">I", buf, 4)[0]
    if little in SUPPORTED_VERSIONS:
        return "<"
    if big in SUPPORTED_VERSIONS:
        return ">"
    raise _Invalid(f"GGUF version {little} is not one this reader knows ({', '.join(map(str, SUPPORTED_VERSIONS))})")


def _tensor_info(header: _Header) -> tuple[int, int]:
    """(offset from the start of the data, size in bytes) of the next tensor in the table; the size is 0 for a ggml
    type newer than the installed gguf package knows (its offset still bounds the data)."""
    name = header.string()
    dims = [header.scalar("Q") for _ in range(header.scalar("I"))]
    ggml_type, offset = header.scalar("I"), header.scalar("Q")
    block, type_size = _block_sizes().get(ggml_type, (1, 0))
    elements = math.prod(dims)
    if elements % block:
        raise _Invalid(f"tensor {name!r} has {elements} elements, not a whole number of type-{ggml_type} blocks")
    return offset, elements // block * type_size


@functools.lru_cache(maxsize=1)
def _block_sizes() -> dict[int, tuple[int, int]]:
    """ggml type code -> (elements per block, bytes per block), from the gguf package."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}
