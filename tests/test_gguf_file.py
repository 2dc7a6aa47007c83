"""The GGUF validator: an intact file passes with what its header says; a file cut anywhere (its metadata, its tensor
table, its tensor data), one that is not a GGUF and one without general.architecture each give one line that names
the option and the file. Reference: the gguf package's own reader on the intact file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from drafter_train.errors import ConfigError
from drafter_train.gguf_file import check_gguf
from tests.gguf_edit import save_gguf


def write_gguf(path: Path, big_endian: bool = False) -> Path:
    """A small GGUF like a converted model's: a vocabulary (a string array), scalars, f32 / f16 / q8_0 tensors."""
    import gguf

    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    writer.add_name("tiny test model")
    writer.add_block_count(2)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_token_scores([0.0] * 300)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((300, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((64, 128), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.1.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))  # small: the last tensor's padding
    save_gguf(writer)
    return path


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "model.gguf")


def test_an_intact_file_passes_with_its_header(intact):
    import gguf

    header = check_gguf(intact, "target.path")
    reader = gguf.GGUFReader(intact)
    ends = [t.data_offset + t.n_bytes for t in reader.tensors]  # the reader's own reading of the tensor table
    assert (header.architecture, header.name, header.version) == ("llama", "tiny test model", 3)
    assert header.tensor_count == len(reader.tensors) == 4
    assert header.file_size == intact.stat().st_size and header.data_end == max(ends) <= header.file_size
    assert header.metadata["llama.block_count"] == 2 and "tokenizer.ggml.tokens" not in header.metadata  # arrays


def test_a_big_endian_file_passes(tmp_path):
    header = check_gguf(write_gguf(tmp_path / "be.gguf", big_endian=True), "drafter.path")
    assert (header.architecture, header.tensor_count) == ("llama", 4)


def _cut_points(intact: Path) -> dict[str, int]:
    import gguf

    raw = intact.read_bytes()
    reader = gguf.GGUFReader(intact)
    data_end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    return {
        "inside the magic": 2,
        "inside the version": 6,
        "inside the counts": 20,
        "inside a metadata key": raw.index(b"general.name") + 4,
        "inside the vocabulary array": raw.index(b"tok150"),
        "inside the tensor table": raw.index(b"blk.1.ffn_up.weight") + 3,
        "at the start of the data": reader.data_offset,
        "inside the first tensor": reader.data_offset + 1000,
        "one byte short of the last tensor's end": data_end - 1,
    }


@pytest.mark.parametrize("where", ["inside the magic", "inside the version", "inside the counts",
                                   "inside a metadata key", "inside the vocabulary array", "inside the tensor table",
                                   "at the start of the data", "inside the first tensor",
                                   "one byte short of the last tensor's end"])
def test_a_file_cut_anywhere_is_one_line_naming_the_file(intact, tmp_path, where):
    size = _cut_points(intact)[where]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(intact.read_bytes()[:size])
    with pytest.raises(ConfigError) as err:
        check_gguf(cut, "target.path")
    message = str(err.value)
    assert message.startswith(f"target.path: {cut}: ") and "\n" not in message
    if size < 4:
        assert "not a GGUF file" in message
    elif size < _cut_points(intact)["at the start of the data"]:
        assert "cut short inside its header" in message
    else:
        assert "cut short inside its tensor data" in message and f"{size:,} bytes" in message


@pytest.mark.parametrize("damage, words", [
    (lambda raw: b"GGUX" + raw[4:], "not a GGUF file"),
    (lambda raw: raw[:4] + (99).to_bytes(4, "little") + raw[8:], "GGUF version 99"),
    (lambda raw: raw.replace(b"general.architecture", b"general.architectur_"), "no general.architecture"),
    (lambda raw: b"", "not a GGUF file"),
    (lambda raw: b"<!DOCTYPE html><html>404 Not Found</html>", "not a GGUF file"),  # a download that got a page
])
def test_not_a_gguf_or_no_architecture_is_one_line(intact, tmp_path, damage, words):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(intact.read_bytes()))
    with pytest.raises(ConfigError) as err:
        check_gguf(bad, "drafter.path")
    assert str(err.value).startswith(f"drafter.path: {bad}: ") and words in str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^target\.path: .*missing\.gguf: No such file"):
        check_gguf(tmp_path / "missing.gguf", "target.path")
