"""The offline feature cache: the target's hidden states over the training data, computed once, reused by every
epoch and every run that trains on the same data with the same target and layers.

Per training record (same order as the distillation dataset) it stores, in 16-bit:
  features       [T, n * H]  the outputs of the chosen target layers (features.py) at every position of
                             prompt + response, as collate() cuts them (train.max_seq_len)
  target_hidden  [R, H]      the target's final (normed) hidden states at the R positions that predict response
                             tokens: the LM head rows of any draft vocabulary give the target's logits from them

Layout: <data_dir>/features/<key>/{features.json, shards/shard-NNNNN/}. The key hashes what the features depend on
(target identity, layers, response column, max_seq_len, dtype), and features.json repeats it readably: a cache made
by another target or layer set is refused in one line. Each shard keeps a digest of every record it was made from
(digests.json: prompt, response and its mask): shards whose records the data no longer holds (datagen run again into
the same folder) are dropped and extracted again, never served for other records. Shards appear by an atomic rename
of a complete temporary folder, so a killed extraction resumes after its last complete shard; under several processes
each rank writes its own shards (shard s belongs to rank s % world_size) and the main process writes features.json.

Tensors are stored as raw bytes (datasets' `binary`): Arrow has no bfloat16, and this keeps them bit-exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import datasets
import torch
from torch import Tensor
from tqdm.auto import tqdm

from drafter_train.data.batches import Batch, collate, mask_key
from drafter_train.data.store import quiet_datasets
from drafter_train.io import write_atomic
from drafter_train.errors import ConfigError

MANIFEST = "features.json"
DIGESTS = "digests.json"  # in each shard: the digests of the records it was made from, in order
FORMAT = "drafter-features/1"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_COLUMNS = datasets.Features({"features": datasets.Value("binary"), "target_hidden": datasets.Value("binary")})


@dataclass(frozen=True)
class CacheSpec:
    """What a feature cache depends on; two runs with equal specs share one cache."""

    target: dict  # model identity (targets.model_identity)
    layers: tuple[int, ...]
    hidden_size: int
    response_key: str
    max_seq_len: int
    dtype: str
    compute: str  # train.mixed_precision the target ran under (no or bf16): the features' bits differ
    shard_size: int = 256

    def as_dict(self) -> dict:
        return {"format": FORMAT, "target": self.target, "layers": list(self.layers), "hidden_size": self.hidden_size,
                "response_key": self.response_key, "max_seq_len": self.max_seq_len, "dtype": self.dtype,
                "compute": self.compute, "shard_size": self.shard_size}

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]


def cache_dir(data_dir: str | Path, spec: CacheSpec) -> Path:
    return Path(data_dir) / "features" / spec.key()


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def _to_bytes(tensor: Tensor, dtype: torch.dtype) -> bytes:
    return tensor.detach().to(dtype=dtype).cpu().contiguous().view(torch.int16).numpy().tobytes()


def _from_bytes(raw: bytes, dtype: torch.dtype, width: int) -> Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.int16).view(dtype).view(-1, width)


def record_digests(data: datasets.Dataset, response_key: str) -> list[str]:
    """A digest per record of what its features are computed from: its prompt, its response and the response's mask."""
    columns = [c for c in ("prompt_ids", response_key, mask_key(response_key)) if c in data.column_names]
    digests = []
    for row in data.select_columns(columns).iter(batch_size=1024):
        for values in zip(*(row[c] for c in columns)):
            digests.append(hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16])
    return digests


def drop_stale(root: Path, spec: CacheSpec, digests: Sequence[str]) -> int:
    """Delete the shards made from other records than the data's now (or from unknown ones: no digests.json), and
    the manifest with them, so that they are extracted again; returns how many. Records beyond the data (a cache over
    more serves a prefix) are not compared."""
    dropped = 0
    for path in sorted(p for p in (root / "shards").glob("shard-*") if p.is_dir()):
        start = int(path.name.split("-")[1]) * spec.shard_size
        made_from = json.loads((path / DIGESTS).read_text()) if (path / DIGESTS).is_file() else None
        now = list(digests[start:start + spec.shard_size])
        if made_from is None or made_from[:len(now)] != now:
            shutil.rmtree(path)
            dropped += 1
    if dropped:
        (root / MANIFEST).unlink(missing_ok=True)
    return dropped


def check_manifest(root: Path, spec: CacheSpec) -> None:
    """Refuse (one line) a cache folder whose recorded spec is not `spec`: another target, layer set, dtype..."""
    path = root / MANIFEST
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    wanted = json.loads(json.dumps(spec.as_dict()))
    changed = [k for k in wanted if saved.get(k) != wanted[k]]
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} != {wanted[k]!r}" for k in changed)
        raise ConfigError(f"drafter.features=offline: the feature cache {root} was made for something else "
                          f"({detail}); delete it or use another train.data_dir")


def build_cache(
    root: Path,
    spec: CacheSpec,
    data: datasets.Dataset,
    extract: Callable[[Batch], tuple[Tensor, Tensor]],
    pad_id: int,
    batch_size: int = 8,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
    digests: Optional[Sequence[str]] = None,
) -> None:
    """Write this rank's missing shards. `extract(batch)` -> (features [B, T, n*H], target_hidden [B, R, H]) from
    one no-grad target forward over a collated batch. `digests`: record_digests(data), when the caller has them."""
    digests = list(digests) if digests is not None else record_digests(data, spec.response_key)
    (root / "shards").mkdir(parents=True, exist_ok=True)
    check_manifest(root, spec)
    num_shards = -(-len(data) // spec.shard_size)
    mine = [s for s in range(num_shards) if s % world_size == rank and not _complete(root, s, spec, len(data))]
    todo = sum(min(spec.shard_size, len(data) - s * spec.shard_size) for s in mine)
    bar = tqdm(total=todo, desc="target features", unit="record", disable=not progress or not todo)
    tokens, seconds = 0, 0.0
    for shard in mine:
        indices = list(range(shard * spec.shard_size, min((shard + 1) * spec.shard_size, len(data))))
        rows: list[Optional[dict]] = [None] * len(indices)
        by_length = sorted(range(len(indices)), key=lambda i: len(data[indices[i]]["prompt_ids"]) +
                           len(data[indices[i]][spec.response_key]))
        for start in range(0, len(by_length), batch_size):
            chunk = by_length[start:start + batch_size]
            records = list(data.select([indices[i] for i in chunk]))
            batch = collate(records, spec.response_key, spec.max_seq_len, pad_id)
            began = time.perf_counter()
            features, hidden = extract(batch)
            seconds += time.perf_counter() - began
            lengths, resp_lengths = batch.attention_mask.sum(1).tolist(), batch.resp_mask.sum(1).tolist()
            tokens += sum(lengths)
            for row, i in enumerate(chunk):
                rows[i] = {"features": _to_bytes(features[row, :lengths[row]], _DTYPES[spec.dtype]),
                           "target_hidden": _to_bytes(hidden[row, :resp_lengths[row]], _DTYPES[spec.dtype])}
            bar.update(len(chunk))
            bar.set_postfix({"tok/s": f"{tokens / max(seconds, 1e-9):.0f}"})
        _write_shard(root, shard, rows, digests[indices[0]:indices[-1] + 1])
    bar.close()


def _complete(root: Path, shard: int, spec: CacheSpec, num_records: int) -> bool:
    """Whether the shard exists with all its records; a short last shard of a smaller dataset (the data grew, or
    train.max_records rose) is deleted, to be extracted again whole."""
    path = root / "shards" / _shard_name(shard)
    if not path.is_dir():
        return False
    if datasets.load_from_disk(str(path)).num_rows == min(spec.shard_size, num_records - shard * spec.shard_size):
        return True
    shutil.rmtree(path)
    return False


def needs_building(root: Path, num_records: int) -> bool:
    """No finished cache yet, or one over fewer records than the data now has (a cache over more serves a prefix)."""
    path = root / MANIFEST
    return not path.is_file() or json.loads(path.read_text())["records"] < num_records


def _write_shard(root: Path, shard: int, rows: list[dict], digests: list[str]) -> None:
    tmp = root / "shards" / f".{_shard_name(shard)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with quiet_datasets():
        datasets.Dataset.from_list(rows, features=_COLUMNS).save_to_disk(str(tmp))
    (tmp / DIGESTS).write_text(json.dumps(digests))
    os.rename(tmp, root / "shards" / _shard_name(shard))


def finish_cache(root: Path, spec: CacheSpec, num_records: int) -> dict:
    """Main process, after every rank wrote its shards: check completeness, write features.json, return it."""
    shards = sorted(p for p in (root / "shards").glob("shard-*") if p.is_dir())
    expected = -(-num_records // spec.shard_size)
    if len(shards) < expected:
        raise ConfigError(f"drafter.features=offline: {root} has {len(shards)} of {expected} feature shards")
    for stale in (root / "shards").glob(".shard-*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    records = sum(datasets.load_from_disk(str(p)).num_rows for p in shards)  # a prefix of it may be all this run uses
    manifest = dict(spec.as_dict(), records=records, shards=len(shards), bytes=size)
    write_atomic(root / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_cache(root: Path, spec: CacheSpec, num_records: int) -> datasets.Dataset:
    """The cache's first ``num_records`` records, aligned index by index with the distillation dataset."""
    check_manifest(root, spec)
    shards = sorted(p for p in (root / "shards").glob("shard-*") if p.is_dir())
    cached = datasets.concatenate_datasets([datasets.load_from_disk(str(p)) for p in shards])
    if len(cached) < num_records:
        raise ConfigError(f"drafter.features=offline: {root} holds {len(cached)} records, the data has {num_records}")
    return cached.select(range(num_records)) if len(cached) > num_records else cached


def attach_features(batch: Batch, records: Sequence[dict], dtype: torch.dtype) -> Batch:
    """Fill batch.features [B, T, F] and batch.target_hidden [B, R, H] from cached records (right-padded with 0;
    the widths come from the batch's first record: H = bytes per response position, F = bytes per position)."""
    row = int(batch.resp_mask.sum(1).argmax())  # a record with response tokens tells both widths
    tokens, resp = int(batch.attention_mask[row].sum()), int(batch.resp_mask[row].sum())
    width = len(records[row]["target_hidden"]) // 2 // resp  # 2 bytes per 16-bit value
    feature_width = len(records[row]["features"]) // 2 // tokens
    features = torch.zeros(*batch.input_ids.shape, feature_width, dtype=dtype)
    hidden = torch.zeros(*batch.resp_pos.shape, width, dtype=dtype)
    for row, record in enumerate(records):
        f = _from_bytes(record["features"], dtype, feature_width)
        h = _from_bytes(record["target_hidden"], dtype, width)
        features[row, :f.shape[0]] = f
        hidden[row, :h.shape[0]] = h
    return dataclasses.replace(batch, features=features, target_hidden=hidden)
