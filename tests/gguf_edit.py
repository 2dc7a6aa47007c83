"""Broken copies of a GGUF file, written with the gguf package: what the llama.cpp engine check must catch (wrong
layer ids, a shuffled d2t, random weights, a dropped norm)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np


def rewrite_gguf(src: Path, dst: Path, fields: Mapping = {}, tensors: Mapping = {}, drop: tuple = ()) -> None:
    """dst = src with some metadata values (`fields`: name -> value) and tensor data (`tensors`: name -> array of
    the same shape) replaced, and the names in `drop` left out; everything else copied as it is."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, fields.get(name, field.contents()), vtype, sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name in drop:
            continue
        data = np.ascontiguousarray(tensors.get(tensor.name, tensor.data))
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    save_gguf(writer)


def save_gguf(writer) -> None:
    """Write a filled gguf.GGUFWriter's file in the order the format wants: header, metadata, tensors."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
