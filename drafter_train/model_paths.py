"""Where a model option (target.path, drafter.path, drafter.cut_from) points, and what its files say, checked before
any weights load: a local HF folder, a .gguf file or a folder plus gguf_file, a hub id, or an embedded target. A
mistyped path is one line at once, and the console scripts check it before torch loads (preflight.py); only the two
checks that read a folder's config and tokenizer through transformers import it, once the folder is known to exist.
targets.py loads what these checks accepted; the tokenizer loader lives here (the checks read tokenizers too), so
the import goes one way, targets -> model_paths.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from drafter_train.errors import ConfigError, ModelNotFoundError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EMBEDDED_PREFIX = "embedded:"
# Any of these in a folder means AutoTokenizer has something to load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def locate(path: str, gguf_file: Optional[str]) -> tuple[str, Optional[str]]:
    """(folder or hub id, GGUF file name or None), failing early and clearly for local paths that cannot work."""
    local = Path(path).expanduser()
    if local.is_file():
        if local.suffix != ".gguf":
            raise ModelNotFoundError(f"{path}: not a .gguf file; pass a HF model folder, a .gguf file or a hub id")
        if gguf_file and gguf_file != local.name:
            raise ModelNotFoundError(f"{path} is a .gguf file but gguf_file names another one ({gguf_file})")
        return str(local.parent), local.name
    if local.is_dir():
        _check_folder(local, path, gguf_file)
        return str(local), gguf_file
    if _looks_local(path):
        # Do not let a mistyped local path fall through to hub look-ups (slow online, confusing offline).
        raise ModelNotFoundError(f"{path}: no such file or folder")
    return path, gguf_file


def _check_folder(folder: Path, path: str, gguf_file: Optional[str]) -> None:
    if gguf_file:
        if not (folder / gguf_file).is_file():
            raise ModelNotFoundError(f"{path}: no GGUF file {gguf_file!r} in this folder")
    elif not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        hint = f"; it holds {', '.join(ggufs)}: name one as gguf_file" if ggufs else ""
        if (folder / "drafter" / "config.json").is_file():  # a training checkpoint (step-N, best, latest)
            hint = f"; it is a drafter-train checkpoint: its drafter is {Path(path) / 'drafter'}"
        raise ModelNotFoundError(f"{path}: folder has no config.json, so it is not a HF model folder{hint}")


def check_model_path(path: str, gguf_file: Optional[str] = None) -> None:
    """The checks `load_causal_lm` makes on a local path, without loading anything: a mistyped folder, a folder that
    is not a model folder, a missing GGUF file (hub ids and embedded targets pass)."""
    if not path.startswith(EMBEDDED_PREFIX):
        locate(path, gguf_file)


def local_gguf(path: str, gguf_file: Optional[str] = None) -> Optional[Path]:
    """The local GGUF file a target or drafter path names (a .gguf file, or a folder plus ``gguf_file``), or None
    (a HF folder, a hub id, the embedded target). The path must have passed `check_model_path`."""
    if path.startswith(EMBEDDED_PREFIX):
        return None
    source, name = locate(path, gguf_file)
    return Path(source) / name if name and Path(source).is_dir() else None


def check_decoder_only(path: str, option: str) -> None:
    """Refuse, in one line and before the weights load, a local model folder whose config is an encoder-decoder
    (T5, BART, Marian, Whisper ...): AutoModelForCausalLM would fail on it with a list of 200 config classes.
    transformers' own `is_encoder_decoder` decides, not a list of model types kept here."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError):  # a model type this transformers does not know: loading says so
        return
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"{option}: {path}: this {config.model_type} model is an encoder-decoder; drafter-datagen, "
                          "drafter-train, drafter-eval and drafter-export take decoder-only models: encoder-decoder "
                          "targets go through drafter-seq2seq (docs/seq2seq.md)")


def check_tokenizer_fits(path: str) -> None:
    """Refuse, in one line and before the weights load, a local target folder whose tokenizer has ids its model cannot
    embed (config vocab_size): such an id (a pad token, a prompt's token) fails as an IndexError in the embedding
    mid-run. transformers picks the tokenizer class by model type for some families (Qwen2 gets Qwen2Tokenizer,
    which adds <|endoftext|> as pad, whatever class the folder declares), so the tokenizer that loads is checked."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file() or not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return  # hub ids, GGUF files, embedded targets: checked by loading
    from transformers import AutoConfig

    rows = getattr(AutoConfig.from_pretrained(folder).get_text_config(), "vocab_size", None)
    tokenizer = load_tokenizer(str(folder))
    beyond = sorted((i, t) for t, i in tokenizer.get_vocab().items() if rows and i >= rows)
    if beyond:
        named = ", ".join(f"{t} = {i}" for i, t in beyond[:3]) + (" ..." if len(beyond) > 3 else "")
        pad = f"; its pad token is {tokenizer.pad_token} = {tokenizer.pad_token_id}" if tokenizer.pad_token else ""
        raise ConfigError(f"target.path: {path}: the tokenizer ({type(tokenizer).__name__}) has ids ({named}) that the "
                          f"model cannot embed: config vocab_size is {rows}{pad}")


def _looks_local(path: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else that does not exist is a mistyped local path."""
    return (
        path.startswith(("/", ".", "~"))
        or path.count("/") > 1
        or (os.sep != "/" and os.sep in path)
        or path.endswith(".gguf")
    )


def load_tokenizer(path: str, gguf_file: Optional[str] = None) -> PreTrainedTokenizerBase:
    """The tokenizer stored with a model (same path rules as ``load_causal_lm``), with a pad token set."""
    source, gguf_file = locate(path, gguf_file)
    if not gguf_file and Path(source).is_dir() and not any(Path(source, f).is_file() for f in TOKENIZER_FILES):
        # Without this, AutoTokenizer fails with a page about sentencepiece and slow tokenizers.
        raise ModelNotFoundError(f"{path}: no tokenizer files in this folder ({', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    tokenizer = from_pretrained(AutoTokenizer, source, gguf_file)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Batched generation left-pads prompts; the pad id is masked out, so reusing EOS is harmless.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def from_pretrained(cls, source: str, gguf_file: Optional[str], **kwargs):
    """cls.from_pretrained of a local folder or file, else the hub; a hub miss is one line (ModelNotFoundError)."""
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if Path(source).is_dir():
        return cls.from_pretrained(source, **kwargs)  # local errors (corrupt weights ...) keep their own message
    try:
        return cls.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:  # offline, unknown repo, invalid repo id, no such file in the repo
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelNotFoundError(
            f"{source}: not a local folder or file, and could not be loaded from the hub: {reason}"
        ) from err
