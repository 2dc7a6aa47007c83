"""A checkpoint's drafter in the files an engine serves, written through the kind's own FORMATS writers and
drafter_train/llamacpp.py (never through drafter-export, whose Hub folder, card and leak scan an engine does not need).

- llama.cpp: drafter.gguf from the kind's `gguf` writer (its layout refusals first, before any conversion); the
  target is a given GGUF file, or the run's target exported at a stated gguf_type once and cached by its
  fingerprint (the target folder's config and weight files, and the type), so every later evaluation reuses it.
- vLLM: the kind's `vllm` folder (EAGLE-3's speculators format, DFlash's folder); a drafter transformers drives as a
  plain causal LM (the AR kind) is served as its own folder (method draft_model).

Every refusal is one line naming `field` (e.g. eval.engine=llamacpp), before anything heavy runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from drafter_train.errors import ConfigError
from drafter_train.llamacpp import DRAFTER_FILE, TARGET_FILE, GgufJob, convert_typed, target_folder

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass
class EngineFiles:
    """What an engine is started with: the target (a GGUF file, or vLLM's HF folder), the drafter (drafter.gguf, or a
    folder) and the engine's speculative method (llama.cpp's --spec-type, vLLM's method)."""

    target: Path
    drafter: Path
    method: str


def engine_method(kind, engine: str, field: str) -> str:
    """The engine's speculative method for a kind; a kind with no export for that engine is refused in one line."""
    from drafter_train.drafters.registry import all_kinds

    if engine == "vllm":
        from drafter_train.engines.vllm_cpu import vllm_method

        return vllm_method(kind, field)
    if "gguf" not in kind.export_formats or "gguf" not in kind.engine_methods:
        with_one = ", ".join(k.name for k in all_kinds() if "gguf" in k.export_formats)
        raise ConfigError(f"{field}: {kind.description} (drafter kind {kind.name}) has no GGUF export for llama.cpp; "
                          f"kinds with one: {with_one}")
    return kind.engine_methods["gguf"]


def check_layout(kind, engine: str, config: dict, field: str) -> None:
    """The kind's own refusal of a layout the engine cannot run (e.g. EAGLE-3's per-layer fc_norm in llama.cpp),
    from the drafter's config (its config.json, or the drafter config before training), named for `field`."""
    check = kind.export_checks.get("gguf" if engine == "llamacpp" else engine)
    if check is None:
        return
    try:
        check(config)
    except ConfigError as err:
        raise ConfigError(f"{field}: {str(err).split(': ', 1)[-1]}") from None


def run_config(drafter_dir: Path) -> dict:
    """The run config beside a checkpoint's drafter/ (RUN/<step>/drafter), empty when it is not in a run folder."""
    from drafter_train.model_card import run_config as read

    run_dir = drafter_dir.resolve().parent.parent
    return read(run_dir / "config.yaml") or read(run_dir / ".hydra" / "config.yaml")


def fingerprint(folder: Path, gguf_type: str) -> str:
    """The target export's cache key: the folder's config.json and tokenizer files by content, its weight files by
    name, size and modification time (hashing gigabytes for a cache key would cost what the export saves), and the
    type."""
    digest = hashlib.sha256(gguf_type.encode())
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            continue
        if path.suffix in WEIGHT_SUFFIXES:
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        elif path.suffix == ".json":
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def default_cache() -> Path:
    return Path(os.environ.get("DRAFTER_TRAIN_CACHE") or Path.home() / ".cache" / "drafter_train") / "engine-targets"


def cached_target_gguf(root: Path, target_dir: Path, gguf_type: str, cache_dir: Optional[Path] = None) -> Path:
    """The target as GGUF at gguf_type, converted once per fingerprint (into a temporary name, renamed when whole)."""
    folder = (cache_dir or default_cache()) / f"{target_dir.name}-{gguf_type}-{fingerprint(target_dir, gguf_type)}"
    out = folder / TARGET_FILE
    if out.is_file():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{TARGET_FILE}.{os.getpid()}"
    try:
        convert_typed(root, target_dir, partial, gguf_type, name="target")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def llama_target_gguf(target: str, gguf_type: str = "f16") -> Path:
    """The named or embedded `target` (a target.path) converted by llama.cpp's converter at gguf_type from its
    dequantised copy (cached_target_gguf), then re-exported under the llama architecture beside it (what llama.cpp's
    EAGLE-3 reads): the agreement stage's target, where llama.cpp and our decoder do the same arithmetic."""
    from drafter_train.llama_reexport import reexport_as_llama
    from drafter_train.llamacpp import llamacpp_dir

    gguf = cached_target_gguf(llamacpp_dir(), target_folder({"path": target}, "agreement"), gguf_type)
    out = gguf.with_name("target.llama.gguf")
    return out if out.is_file() else reexport_as_llama(gguf, out)


def export_llamacpp(drafter_dir: Path, out: Path, root: Path, gguf_type: str, field: str, target: dict,
                    draft_len: int, target_gguf: Optional[Path] = None,
                    cache_dir: Optional[Path] = None) -> EngineFiles:
    """drafter.gguf in `out` (the kind's gguf writer) and the target GGUF (given, else the cached export of `target`,
    a target config as a dict: path, cache_dir)."""
    from drafter_train.drafters.registry import folder_kind, get_kind

    kind = folder_kind(str(drafter_dir)) or get_kind("ar")
    method = engine_method(kind, "llamacpp", field)
    check_layout(kind, "llamacpp", folder_config(drafter_dir), field)  # before the target is even looked for
    config = run_config(drafter_dir)
    target_dir = target_folder(target, field)
    keep_embeddings = not config.get("drafter", {}).get("freeze_embeddings", True)
    if out.exists():
        shutil.rmtree(out)
    job = GgufJob(root, target_dir, gguf_type, with_target=False)
    try:
        kind.export_formats["gguf"](drafter_dir, out, draft_len, str(target_dir), keep_embeddings, job=job)
    except ConfigError as err:  # the kind's layout refusal, named for the field the user set
        raise ConfigError(f"{field}: {str(err).split(': ', 1)[-1]}") from None
    gguf = Path(target_gguf) if target_gguf else cached_target_gguf(root, target_dir, gguf_type, cache_dir)
    return EngineFiles(target=gguf, drafter=out / DRAFTER_FILE, method=method)


def export_vllm(drafter_dir: Path, out: Path, field: str, target: Optional[dict] = None,
                draft_len: Optional[int] = None) -> EngineFiles:
    """The kind's vLLM folder in `out` (or the drafter's own folder for a plain causal LM) and the target's folder.
    target (path, cache_dir) and draft_len: default the run's."""
    from drafter_train.drafters.registry import folder_kind, get_kind
    from drafter_train.model_card import target_names
    from drafter_train.targets import EMBEDDED_PREFIX, embedded_folder

    kind = folder_kind(str(drafter_dir)) or get_kind("ar")
    method = engine_method(kind, "vllm", field)
    config = run_config(drafter_dir)
    target = target if target is not None else config.get("target", {})
    path = str(target.get("path", ""))
    target_dir = embedded_folder(path, target.get("cache_dir")) if path.startswith(EMBEDDED_PREFIX) else Path(path)
    if "vllm" not in kind.export_formats:
        return EngineFiles(target=target_dir.absolute(), drafter=drafter_dir.absolute(), method=method)
    if out.exists():
        shutil.rmtree(out)
    draft_len = draft_len or int(config.get("drafter", {}).get("draft_len") or 1)
    keep_embeddings = not config.get("drafter", {}).get("freeze_embeddings", True)
    verifier = target_names(_info(drafter_dir, config, draft_len), None)[2]
    kind.export_formats["vllm"](drafter_dir, out, draft_len, verifier, keep_embeddings)
    return EngineFiles(target=target_dir.absolute(), drafter=out, method=method)


def folder_config(drafter_dir: Path) -> dict:
    import json

    path = drafter_dir / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _info(drafter_dir: Path, config: dict, draft_len: int):
    from drafter_train.model_card import RunInfo

    return RunInfo(drafter_dir.parent, None, config, {}, [], draft_len)
