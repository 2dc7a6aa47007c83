"""Checks of a job config that need no model: every path it names, before anything loads, so a mistyped path is one
line at once, not after minutes of loading the target and timing its kernels. The entry points call `check_inputs`
first; a kind with its own training procedure (layer-skip's search) calls it after checking its own settings.

The console scripts run these checks before their recipe (and torch, transformers, datasets) is imported: this
module imports none of them itself. What reads an existing model folder's config or tokenizer imports transformers
there (model_paths.py), after every path has been found to exist."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

from drafter_train.data.prompts import check_prompt_file
from drafter_train.drafters.registry import is_saved_drafter
from drafter_train.errors import ConfigError, ModelNotFoundError
from drafter_train.gguf_file import check_gguf
from drafter_train.model_paths import (EMBEDDED_PREFIX, check_decoder_only, check_model_path, check_tokenizer_fits,
                                       local_gguf)


def check_inputs(cfg) -> None:
    """Every path a job config names, and what can be checked of it without a model, before anything loads: a
    mistyped path is one line at once, not after minutes of loading the target and timing its kernels."""
    target, drafter = getattr(cfg, "target", None), getattr(cfg, "drafter", None)
    if target is not None:
        _named("target.path", lambda: check_model_path(target.path, target.gguf_file))
        check_model_files(target.path, "target.path", target.gguf_file)
        if not target.gguf_file:
            check_tokenizer_fits(target.path)  # a pad or prompt id past the embedding: not an IndexError mid-run
        check_attention(target, getattr(cfg, "eval", None))
    if drafter is not None and is_saved_drafter(drafter.path):
        _named("drafter.path", lambda: check_model_path(drafter.path))
        check_model_files(drafter.path, "drafter.path")
        check_outside_drafter(drafter.path)
    if getattr(drafter, "cut_from", "target") != "target":  # the AR kind's other model to cut (drafters/ar)
        check_cut_from(drafter.cut_from)
    for option, folder in _data_folders(cfg):
        if folder and not Path(folder).expanduser().is_dir():
            raise ConfigError(f"{option}: {folder}: no such folder")
    if hasattr(cfg, "train"):
        check_data_finished(cfg.train.data_dir)
        check_has_target_answers(cfg.train.data_dir, cfg.train.response)
    for option, prompts in (("eval", getattr(getattr(cfg, "eval", None), "prompts", None)),
                            ("datagen", getattr(getattr(cfg, "datagen", None), "prompts", None))):
        if prompts and (Path(prompts).suffix or Path(prompts).expanduser().is_absolute()):  # a file, not a hub id
            check_prompt_file(prompts, option)


def check_outside_drafter(path: str) -> None:
    """A drafter folder another tool wrote (speculators, ModelOpt): what its kind cannot map, in one line."""
    from drafter_train.drafters.registry import folder_kind  # discovers the kinds: only for a saved folder

    kind = folder_kind(path) if Path(path).is_dir() else None
    if kind is not None and kind.check_folder is not None:
        kind.check_folder(path)


def check_has_target_answers(data_dir: str, response: str) -> None:
    """train.response=target on a folder datagen wrote without generating (datagen.generate=false) would train on
    empty answers: refuse it in one line."""
    from drafter_train.data.store import MANIFEST  # imports datasets: only once the folder is known to exist

    manifest = Path(data_dir).expanduser() / MANIFEST
    if response != "target" or not manifest.is_file():
        return
    if json.loads(manifest.read_text()).get("generation", {}).get("generate") is False:
        raise ConfigError(f"train.response=target: {data_dir} holds no target answers (made with "
                          f"datagen.generate=false); train on its reference answers with train.response=reference")


def check_data_finished(data_dir: str) -> None:
    """Refuse in one line a datagen folder that drafter-datagen has not finished (still being written, or stopped):
    training would read the shards done so far and say nothing. Finished: datagen.json says complete."""
    from drafter_train.data.store import MANIFEST  # imports datasets: only once the folder is known to exist

    manifest = Path(data_dir).expanduser() / MANIFEST
    if not manifest.is_file():
        return  # not a datagen folder: the data loader says so
    record = json.loads(manifest.read_text())
    if record.get("complete") is not True:
        done = sum(entry.get("prompts", 0) for entry in record.get("shards", []))
        planned = record.get("counts", {}).get("train_prompts", "?")
        raise ConfigError(f"train.data_dir: {data_dir} is not finished by drafter-datagen ({done} of {planned} "
                          f"training prompts in {len(record.get('shards', []))} of "
                          f"{record.get('counts', {}).get('shards_total', '?')} shards): it is still being written or "
                          "was stopped; rerun its drafter-datagen command to finish it")


def check_cut_from(value: str) -> None:
    """drafter.cut_from names a model that exists: a named target installed, a local path there (and whole)."""
    from drafter_train.targets import embedded_gguf, named_path

    path = named_path(value)
    if path.startswith(EMBEDDED_PREFIX):
        _named("drafter.cut_from", lambda: embedded_gguf(path))
        return
    _named("drafter.cut_from", lambda: check_model_path(path))
    if Path(path).expanduser().exists():
        check_model_files(path, "drafter.cut_from")


def check_model_files(path: str, option: str, gguf_file: Optional[str] = None) -> None:
    """What a model path's files say before they load: a GGUF file is whole (header, size against its tensor table)
    and a HF folder is not an encoder-decoder. Called once the path itself is known to exist."""
    gguf = local_gguf(path, gguf_file)
    if gguf is not None:
        check_gguf(gguf, option)
    else:
        check_decoder_only(path, option)


def flash_attention_available() -> bool:
    return _cuda_available() and importlib.util.find_spec("flash_attn") is not None


def _cuda_available() -> bool:
    import torch  # only for target.attn_implementation=flash_attention_2

    return torch.cuda.is_available()


def check_attention(cfg, eval_cfg=None) -> None:
    """Refuse, before anything loads, an attention kernel (target.attn_implementation, a TargetConfig) this machine
    or this evaluation cannot use."""
    if cfg.attn_implementation != "flash_attention_2":
        return
    if not flash_attention_available():
        raise ConfigError("target.attn_implementation=flash_attention_2 needs a CUDA GPU and the flash-attn package "
                          f"(here: GPU {'yes' if _cuda_available() else 'none'}, flash-attn "
                          f"{'yes' if importlib.util.find_spec('flash_attn') else 'not installed'}); use sdpa")
    if eval_cfg is not None and (eval_cfg.tree.enabled or eval_cfg.calibration.enabled):
        raise ConfigError("target.attn_implementation=flash_attention_2 takes no tree masks, which eval.tree and "
                          "eval.calibration verify with; use sdpa")


def _named(option: str, check) -> None:
    """Run `check`, naming the option in its one-line error."""
    try:
        check()
    except ModelNotFoundError as err:
        raise ModelNotFoundError(f"{option}: {err}") from None


def _data_folders(cfg) -> list[tuple[str, Optional[str]]]:
    folders = []
    if hasattr(cfg, "train"):
        folders.append(("train.data_dir", cfg.train.data_dir))
    if hasattr(cfg, "eval"):
        folders.append(("eval.lookup.corpus.path", cfg.eval.lookup.corpus.path))
        folders += [("eval.overlap_with", folder) for folder in cfg.eval.overlap_with]
    corpus = getattr(getattr(cfg, "drafter", None), "corpus", None)
    if corpus is not None:
        folders.append(("drafter.corpus.path", corpus.path))
    return folders


def check_writable(path: Path) -> None:
    """Fail before the (long) evaluation rather than after it, leaving no empty file behind if it fails."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as err:
        raise ConfigError(f"eval.output: cannot write {path}: {err.strerror}") from None
