"""Prompt sources: the built-in set and local json / jsonl / txt files, and one-line errors for bad files."""

import json

import pytest

from drafter_train.data.prompts import DEFAULT_PROMPTS, load_prompts
from drafter_train.errors import ConfigError


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_default_prompts():
    assert len(DEFAULT_PROMPTS) >= 30 and len(set(DEFAULT_PROMPTS)) == len(DEFAULT_PROMPTS)
    assert all(isinstance(p, str) and p.strip() == p and p for p in DEFAULT_PROMPTS)
    assert load_prompts(None, 5) == DEFAULT_PROMPTS[:5]
    assert load_prompts(None, 1000) == DEFAULT_PROMPTS  # fewer than asked: all of them
    load_prompts(None, 2).append("x")
    assert "x" not in DEFAULT_PROMPTS  # callers get a copy


def test_json_list_of_strings(tmp_path):
    path = write(tmp_path / "p.json", json.dumps(["first prompt", "second prompt", "third"]))
    assert load_prompts(path, 2) == ["first prompt", "second prompt"]
    assert load_prompts(path, 10) == ["first prompt", "second prompt", "third"]


def test_json_records_pick_a_known_column(tmp_path):
    rows = [{"id": i, "instruction": f"do {i}", "question": "ignored"} for i in range(3)]
    path = write(tmp_path / "p.json", json.dumps(rows))
    assert load_prompts(path, 3) == ["do 0", "do 1", "do 2"]  # instruction comes before question


def test_jsonl_with_field(tmp_path):
    lines = [json.dumps({"prompt": "not this", "query": f"q{i}"}) for i in range(4)]
    path = write(tmp_path / "p.jsonl", "\n".join(lines) + "\n")
    assert load_prompts(path, 3, field="query") == ["q0", "q1", "q2"]
    assert load_prompts(path, 3) == ["not this"] * 3


def test_txt_one_prompt_per_non_empty_line(tmp_path):
    path = write(tmp_path / "p.txt", "first line\n\n   \nsecond line  \nthird\n")
    assert load_prompts(path, 10) == ["first line", "second line", "third"]
    assert load_prompts(path, 1) == ["first line"]


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^eval.prompts: no such file: .*nope.jsonl$"):
        load_prompts(str(tmp_path / "nope.jsonl"), 3)
    with pytest.raises(ConfigError, match=r"^eval.prompts: not a file: "):
        load_prompts(str(tmp_path), 3)


def test_unsupported_extension(tmp_path):
    with pytest.raises(ConfigError, match="unsupported file type '.csv'"):
        load_prompts(write(tmp_path / "p.csv", "a,b\n"), 3)


def test_no_text_column_lists_columns(tmp_path):
    path = write(tmp_path / "p.jsonl", json.dumps({"id": 1, "body": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"none of the columns prompt, text, .* \(columns: id, body\)"):
        load_prompts(path, 3)
    with pytest.raises(ConfigError, match=r"^eval.prompt_field: .* has no column 'title' \(columns: id, body\)"):
        load_prompts(path, 3, field="title")
    with pytest.raises(ConfigError, match="column 'id' .* holds int, not text"):
        load_prompts(path, 3, field="id")


@pytest.mark.parametrize("name, text", [("e.jsonl", ""), ("e.txt", ""), ("b.txt", "\n  \n"), ("l.json", "[]")])
def test_empty_files(tmp_path, name, text):
    with pytest.raises(ConfigError, match=r"^eval.prompts: .*(empty|no prompts|could not read)"):
        load_prompts(write(tmp_path / name, text), 3)


def test_malformed_json(tmp_path):
    with pytest.raises(ConfigError, match="could not read .* as json"):
        load_prompts(write(tmp_path / "bad.json", '{"prompt": "x"'), 3)
