"""The datagen output folder: resumable shards of a `datasets` dataset, plus datagen.json and the eval prompts.

Layout of ``output_dir``::

    datagen.json          settings (target identity, generation, prompt source), counts, finished shards
    eval_prompts.jsonl    {"prompt": text} per line: held out, never in any shard
    shards/shard-00000/   `Dataset.save_to_disk` of training prompts [0, shard_size), then shard-00001 ...

A shard folder only ever appears by renaming a complete temporary folder (``shards/.shard-NNNNN.tmp-PID``), so an
existing ``shard-NNNNN`` is complete; a run killed mid-shard leaves only a temporary folder, which the next run
deletes and redoes. One writer per output folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import datasets

from drafter_train.io import write_atomic
from drafter_train.errors import ConfigError

MANIFEST = "datagen.json"
EVAL_PROMPTS = "eval_prompts.jsonl"
SHARDS = "shards"
FORMAT = "drafter-datagen/1"
# datagen.json sections that must be identical for a rerun to continue the same data.
COMPARED = ("format", "target", "generation", "prompts")
# Compared settings added after FORMAT was first written, with the value that older folders were made with.
IMPLIED = {("generation", "backend"): "hf", ("generation", "generate"): True, ("generation", "samples_per_prompt"): 1}
# Compared settings a rerun may raise: more training prompts grow the folder (the selection walks the source in
# order, so the old prompts are a prefix of the new ones; run_datagen checks that through the prefix's sha256).
GROWABLE = {("prompts", "num_prompts")}
_SHARD_NAME = re.compile(r"^shard-\d{5}$")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def features(store_topk: int, multi_turn: bool = False) -> datasets.Features:
    """Column types, explicit so that empty lists (no reference answer) still get a type. Multi-turn folders
    (datagen.multi_turn, data/conversations.py) add the assistant masks and what regeneration kept and dropped."""
    ids = datasets.List(datasets.Value("int32"))
    columns = {
        "prompt_index": datasets.Value("int64"),  # position among the training prompts
        "prompt": datasets.Value("string"),
        "prompt_ids": ids,
        "response_ids": ids,
        "reference_ids": ids,
    }
    if store_topk:
        columns["topk_ids"] = datasets.List(ids)  # [T][k]
        columns["topk_logits"] = datasets.List(datasets.List(datasets.Value("float32")))  # [T][k]
    if multi_turn:
        mask = datasets.List(datasets.Value("int8"))
        columns.update(response_mask=mask, reference_mask=mask,  # 1: an assistant token, learned
                       conversation=datasets.Value("string"),  # the kept messages as JSON
                       dropped_turns=datasets.Value("int32"), cut_turns=datasets.Value("int32"))
    return datasets.Features(columns)


class DatagenStore:
    """Reads and writes one output folder; ``manifest`` is datagen.json's content (None before the first run)."""

    def __init__(self, root: Path):
        self.root = root
        self.manifest: Optional[dict] = _read_json(root / MANIFEST)

    @classmethod
    def open(cls, output_dir: str) -> "DatagenStore":
        """Fails with one line, before any model is loaded, when the folder cannot be written."""
        root = Path(output_dir).expanduser()
        try:
            (root / SHARDS).mkdir(parents=True, exist_ok=True)
            probe = root / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"datagen.output_dir: cannot write {root}: {err.strerror or err}") from None
        store = cls(root)
        if store.manifest is None and store.finished_shards():
            raise ConfigError(f"datagen.output_dir: {root} holds shards but no {MANIFEST}; use a new output_dir")
        return store

    def check_settings(self, settings: dict) -> None:
        """Refuse to continue data made with other settings (only keys present in ``settings`` are compared)."""
        if self.manifest is None:
            return
        changes = _differences(self.manifest, _plain(settings))
        if changes:
            raise ConfigError(
                f"datagen.output_dir: {self.root} was written with other settings ({'; '.join(changes)}); "
                "rerun with the same settings to resume, or use a new output_dir"
            )

    def grown_from(self, num_prompts: int) -> Optional[int]:
        """The folder's training prompt count when a rerun asks for more (``num_prompts``), else None."""
        old = (self.manifest or {}).get("prompts", {}).get("num_prompts")
        return old if old is not None and old < num_prompts else None

    def redo_short_shards(self, num_train: int, shard_size: int, samples_per_prompt: int = 1) -> list[str]:
        """Delete finished shards that hold fewer prompts than the selection now puts in them (a grown folder's old
        last shard; samples_per_prompt records each); they are generated again, whole. Returns their names."""
        redo = []
        for path in self._shard_paths():
            index = int(path.name.removeprefix("shard-"))
            prompts = min(shard_size, num_train - index * shard_size)
            if datasets.load_from_disk(str(path)).num_rows != prompts * samples_per_prompt:
                shutil.rmtree(path)
                redo.append(path.name)
        return redo

    def start(self, manifest: dict, eval_prompts: Sequence[str]) -> None:
        """Write the eval prompts and datagen.json; forget temporary folders of a killed run."""
        for stale in (self.root / SHARDS).glob(".shard-*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        lines = "".join(json.dumps({"prompt": text}, ensure_ascii=False) + "\n" for text in eval_prompts)
        write_atomic(self.root / EVAL_PROMPTS, lines)
        self.manifest = dict(_plain(manifest), shards=[_shard_entry(p) for p in self._shard_paths()])
        self._save()

    def finished_shards(self) -> set[str]:
        return {path.name for path in self._shard_paths()}

    def write_shard(self, index: int, records: list[dict], store_topk: int, multi_turn: bool = False) -> None:
        """Save one shard: temporary folder first, then a rename (atomic on one file system)."""
        name = shard_name(index)
        tmp = self.root / SHARDS / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        with quiet_datasets():  # its "Saving the dataset" bar would break up datagen's own progress bar
            datasets.Dataset.from_list(records, features=features(store_topk, multi_turn)).save_to_disk(str(tmp))
        os.rename(tmp, self.root / SHARDS / name)
        for side in (self.root / SHARDS).glob(f".{name}.*"):  # e.g. its multi-turn progress file: done with
            if side.is_file():
                side.unlink()
        self.manifest["shards"].append(_shard_entry(self.root / SHARDS / name))
        self._save()

    def finish(self) -> None:
        self.manifest["complete"] = len(self.manifest["shards"]) == self.manifest["counts"]["shards_total"]
        self._save()

    def response_tokens(self) -> int:
        return sum(entry["response_tokens"] for entry in self.manifest["shards"])

    def total(self, key: str) -> int:
        """A per-shard count summed over the finished shards (0 where shards do not have it)."""
        return sum(entry.get(key, 0) for entry in self.manifest["shards"])

    def _shard_paths(self) -> list[Path]:
        return shard_paths(self.root)

    def _save(self) -> None:
        self.manifest["shards"].sort(key=lambda entry: entry["name"])
        write_atomic(self.root / MANIFEST, json.dumps(self.manifest, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# Readers for consumers (the trainer, the evaluator)


def load_distill_dataset(data_dir: str | Path) -> datasets.Dataset:
    """All finished shards of a datagen folder as one dataset, in prompt order (memory-mapped, not loaded).

    An interrupted run gives the shards it finished; datagen.json's ``complete`` says whether that is all.
    """
    root = _datagen_folder(data_dir, "empty dataset")
    paths = shard_paths(root)
    if not paths:
        raise ConfigError(f"{data_dir}: empty dataset (no finished shards in {root / SHARDS})")
    return datasets.concatenate_datasets([datasets.load_from_disk(str(p)) for p in paths])


def load_eval_prompts(data_dir: str | Path) -> list[str]:
    """The held-out evaluation prompts of a datagen folder, in order (may be empty: num_eval_prompts=0)."""
    path = _datagen_folder(data_dir, "no eval prompts") / EVAL_PROMPTS
    if not path.is_file():
        raise ConfigError(f"{data_dir}: no {EVAL_PROMPTS}")
    return [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id, added tokens included): two tokenizers with equal
    fingerprints give token ids the same meaning, whatever models they came with."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def data_fingerprint(data_dir: str | Path) -> str:
    """sha256 of what a datagen folder's records are (target, generation and prompt settings, the selection's sha256,
    the training prompt count), wherever the folder lies: a run moved to another machine checks its data by this."""
    manifest = json.loads((_datagen_folder(data_dir, "no data") / MANIFEST).read_text())
    identity = {key: manifest.get(key) for key in (*COMPARED, "counts")}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def check_tokenizer(data_dir: str | Path, tokenizer, option: str) -> None:
    """Refuse (one line) a datagen folder whose token ids come from another tokenizer than `tokenizer`'s. Folders
    written before datagen.json recorded the fingerprint are taken as they are."""
    manifest = json.loads((_datagen_folder(data_dir, "no data") / MANIFEST).read_text())
    recorded = manifest.get("run", {}).get("tokenizer_sha256")
    if recorded and recorded != tokenizer_fingerprint(tokenizer):
        made_for = manifest.get("target", {}).get("path", "another target")
        raise ConfigError(f"{option}: {data_dir} holds token ids of another tokenizer (made with {made_for}'s); "
                          f"make data for this target with drafter-datagen")


def unfinished(data_dir: str | Path) -> Optional[str]:
    """How far a datagen folder that is not finished got, e.g. '40 of 240 training prompts done (1 of 6 shards)';
    None for a finished one, and for a folder without datagen.json or counts (nothing to tell it by). Unfinished:
    datagen.json says complete=false (written at the start of every run, true only at its end) or it plans more
    shards than are finished: a run still writing, or one that was stopped."""
    root = Path(data_dir).expanduser()
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    # the shards datagen.json records as finished (a folder is written before its entry), else those on disk
    shards = len(manifest["shards"]) if "shards" in manifest else len(shard_paths(root))
    planned = manifest.get("counts", {}).get("shards_total")
    if manifest.get("complete") is not False and (planned is None or shards >= planned):
        return None
    done = sum(entry.get("prompts", 0) for entry in manifest.get("shards", []))
    total = manifest.get("counts", {}).get("train_prompts", "?")
    return f"{done} of {total} training prompts done ({shards} of {planned if planned is not None else '?'} shards)"


def check_finished(data_dir: str | Path, option: str, allow: str) -> None:
    """Refuse (one line) to read a datagen folder that is not finished: training on what happens to be there would
    say nothing of it. `allow` is the setting that takes it as it is (e.g. train.allow_partial_data=true)."""
    progress = unfinished(data_dir)
    if progress is not None:
        raise ConfigError(f"{option}: {data_dir} is a drafter-datagen folder not finished (still being written, or "
                          f"stopped): {progress}; finish it by rerunning drafter-datagen with the same settings, or "
                          f"take what is there with {allow}")


def shard_paths(root: Path) -> list[Path]:
    """The finished shard folders of a datagen folder, in order."""
    return sorted(p for p in (root / SHARDS).glob("shard-*") if p.is_dir() and _SHARD_NAME.match(p.name))


def _datagen_folder(data_dir: str | Path, problem: str) -> Path:
    root = Path(data_dir).expanduser()
    if not (root / MANIFEST).is_file():
        raise ConfigError(f"{data_dir}: {problem} (no {MANIFEST}: not a drafter-datagen output folder)")
    return root


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _shard_entry(path: Path) -> dict:
    """Counted from the shard itself: a run killed between the rename and the datagen.json update loses nothing."""
    shard = datasets.load_from_disk(str(path))
    responses = shard["response_ids"]
    entry = {"name": path.name, "prompts": len(set(shard["prompt_index"])),
             "response_tokens": sum(len(r) for r in responses),
             "reference_tokens": sum(len(r) for r in shard["reference_ids"])}
    if len(responses) != entry["prompts"]:  # datagen.samples_per_prompt > 1: several answers per prompt
        entry["records"] = len(responses)
    if "dropped_turns" in shard.column_names:  # multi-turn: what the length rules took away, never silently
        dropped = shard["dropped_turns"]
        entry.update(truncated_conversations=sum(n > 0 for n in dropped), dropped_turns=sum(dropped),
                     cut_turns=sum(shard["cut_turns"]))
    return entry


def _differences(old: dict, new: dict) -> list[str]:
    changes = []
    for section in COMPARED:
        if section not in new:
            continue
        if not isinstance(new[section], dict):
            if old.get(section) != new[section]:
                changes.append(f"{section}: {old.get(section)!r} -> {new[section]!r}")
            continue
        before = old.get(section) or {}
        changes += [
            f"{section}.{key}: {before.get(key, IMPLIED.get((section, key)))!r} -> {value!r}"
            for key, value in new[section].items()
            if before.get(key, IMPLIED.get((section, key))) != value
            and not ((section, key) in GROWABLE and isinstance(value, int) and before.get(key, value) < value)
        ]
    return changes


@contextmanager
def quiet_datasets() -> Iterator[None]:
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def _plain(value: dict) -> dict:
    """What the dict reads back as from JSON (tuples become lists), so comparisons with datagen.json are fair."""
    return json.loads(json.dumps(value))


def _read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"datagen.output_dir: cannot read {path}: {err}") from None


