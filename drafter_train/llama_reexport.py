"""A qwen2 GGUF re-exported under llama.cpp's ``llama`` architecture, bit for bit the same model.

Why: llama.cpp's EAGLE-3 and DFlash drafters read the target's hidden states from the layer inputs each
architecture's graph exposes (``t_layer_inp``); its ``llama`` graph exposes them and its ``qwen2`` graph does not, so
a drafter served on a qwen2 file aborts ("layer input tensor is null"). A qwen2 layer is a llama layer with q/k/v
biases, which llama's loader takes as optional tensors. What differs is the rope:

- qwen2 runs the NEOX rope: dimension i of a head rotates with i + d/2 (HF's ``rotate_half``);
- llama runs the NORM rope: dimension 2i rotates with 2i + 1. llama.cpp's converter therefore permutes a llama's q/k
  rows (``LlamaModel.permute`` in convert_hf_to_gguf.py) so that the pair (i, i + d/2) lands on (2i, 2i + 1).

So the re-export renames the ``qwen2.*`` metadata keys to ``llama.*``, applies that row permutation to the q/k weights
and biases (per head, with the key/value head count for k), and copies everything else. A quantised tensor's row is
whole blocks of its own, so rows move whole and no value is requantised: the result computes what the original does.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

import numpy as np

from drafter_train.errors import ConfigError
from drafter_train.gguf_file import check_gguf

SOURCE_ARCH, TARGET_ARCH = "qwen2", "llama"
_PERMUTED = {"attn_q": "attention.head_count", "attn_k": "attention.head_count_kv"}  # tensor -> its head count key


def neox_to_norm_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a q or k projection (weight [out, ...] or bias [out]) from NEOX-rope order to NORM-rope order:
    within each head, row j of the first half and row j of the second half become rows 2j and 2j + 1."""
    out = rows.shape[0]
    if out % (2 * n_head):
        raise ConfigError(f"{out} rows do not split into {n_head} heads of an even size")
    return rows.reshape(n_head, 2, out // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def reexport_as_llama(src: Union[str, Path], dst: Union[str, Path]) -> Path:
    """Write ``dst``: the qwen2 GGUF ``src`` under the llama architecture (module doc), atomically (a temporary file
    in dst's folder, renamed when complete)."""
    import gguf  # the gguf package: reader and writer (a dependency of transformers' GGUF loading)

    src, dst = Path(src), Path(dst)
    header = check_gguf(src, "the re-export's source")
    if header.architecture != SOURCE_ARCH:
        raise ConfigError(f"{src}: its architecture is {header.architecture!r}; only {SOURCE_ARCH} GGUFs are "
                          f"re-exported as {TARGET_ARCH}")
    reader = gguf.GGUFReader(src)
    heads = {tensor: int(reader.fields[f"{SOURCE_ARCH}.{key}"].contents()) for tensor, key in _PERMUTED.items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.tmp-", dir=dst.parent)
    os.close(fd)
    try:
        _write(gguf, reader, Path(tmp_name), heads)
        os.chmod(tmp_name, 0o644)
        os.rename(tmp_name, dst)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    return dst


def _write(gguf, reader, out: Path, heads: dict[str, int]) -> None:
    writer = gguf.GGUFWriter(out, TARGET_ARCH)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        key = TARGET_ARCH + name[len(SOURCE_ARCH):] if name.startswith(SOURCE_ARCH + ".") else name
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for tensor in reader.tensors:
        data = tensor.data  # [rows, elements] (float) or [rows, bytes] (quantised): a row is whole blocks
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        if kind in heads:  # blk.N.attn_q.weight / .bias, blk.N.attn_k.weight / .bias
            data = neox_to_norm_rows(np.asarray(data), heads[kind])
        writer.add_tensor(tensor.name, np.ascontiguousarray(data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(out, "rb+") as f:
        os.fsync(f.fileno())
