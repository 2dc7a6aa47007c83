"""Source/target pairs from local files, and the target's own outputs for them (what the drafters learn).

`read_pairs` reads a .jsonl / .json / .parquet file or a `datasets` folder (save_to_disk) through `datasets`;
a missing path, an unknown format or a missing column is a one-line ConfigError naming the field, before any model
loads. `regenerate` replaces the references by the target's greedy outputs (SpecDec and DistillSpec train on the
target's outputs), appending each to a jsonl cache as it is made: a rerun resumes after the last written row, and a
cache written for other sources is refused rather than mixed in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from transformers import PreTrainedModel

from drafter_train.errors import ConfigError
from drafter_train.seq2seq.decoding import generate_seq2seq_autoregressive
from drafter_train.seq2seq.target import Source
from drafter_train.seq2seq.training import Example

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_pairs(path: str, source_key: str = "source", target_key: Optional[str] = "target") -> list[dict]:
    """Rows {"source": str, "reference": str | None}. target_key None: sources only (the target writes the rest)."""
    import datasets

    file = Path(path)
    if not file.exists():
        raise ConfigError(f"data.path: {path} does not exist")
    if file.is_dir():
        rows = datasets.load_from_disk(str(file))
    elif file.suffix in FILE_FORMATS:
        rows = datasets.load_dataset(FILE_FORMATS[file.suffix], data_files=str(file), split="train")
    else:
        raise ConfigError(f"data.path: {path} is neither a datasets folder nor one of {sorted(FILE_FORMATS)}")
    for field, key in (("data.source_key", source_key), ("data.target_key", target_key)):
        if key is not None and key not in rows.column_names:
            raise ConfigError(f"{field}: {path} has no column {key!r} (columns: {', '.join(rows.column_names)})")
    return [{"source": row[source_key], "reference": row[target_key] if target_key else None} for row in rows]


def _cached(cache: Path, sources: Sequence[str]) -> list[dict]:
    rows = [json.loads(line) for line in cache.read_text().splitlines() if line.strip()] if cache.is_file() else []
    if [row["source"] for row in rows] != list(sources[: len(rows)]):
        raise ConfigError(f"data.output: {cache} holds outputs for other sources; remove it or choose another folder")
    return rows


def regenerate(target: PreTrainedModel, tokenizer, sources: Sequence[str], cache: str,
               max_new_tokens: int) -> list[Example]:
    """The target's greedy output for every source (token ids, EOS included), cached in the jsonl file `cache`."""
    path = Path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = _cached(path, sources)
    with path.open("a") as out:
        for text in sources[len(rows):]:
            source_ids = tokenizer(text)["input_ids"]
            output = generate_seq2seq_autoregressive(target, Source.text(source_ids, target.device), max_new_tokens)
            rows.append({"source": text, "source_ids": source_ids, "output_ids": output.tokens})
            out.write(json.dumps(rows[-1]) + "\n")
            out.flush()
    return [Example(row["source_ids"], row["output_ids"]) for row in rows]
