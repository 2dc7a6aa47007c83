"""`drafter-export`: one checkpoint of a drafter-train run -> a Hub-ready folder (weights, config, tokenizer,
generation config, model card), optionally pushed to the Hub.

The folder is built in a hidden sibling and renamed into place, so a failed export never leaves half a folder. Nothing
that names this machine (absolute paths, the home folder, load-time flags) reaches the exported files: JSON configs are
scrubbed, the card only shows public names, and a final scan refuses to finish if a local path still appears.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from drafter_train.checkpoint import step_dirs, verify_checkpoint
from drafter_train.config import ExportConfig, ExportJobConfig
from drafter_train.recipes.cli import export_main
from drafter_train.errors import CheckpointDamagedError, ConfigError, DrafterTrainError
from drafter_train.llamacpp import GgufJob, llamacpp_dir, target_folder
from drafter_train.model_paths import check_decoder_only
from drafter_train.model_card import MARKER, RunInfo, looks_local, model_card, read_run_info, step_text, target_names

# Keys that describe how a file was loaded on the training machine, not the model.
_LOAD_TIME_KEYS = {"_name_or_path", "name_or_path", "_commit_hash", "is_local", "local_files_only"}
# The files whose text the export writes or rewrites (card and configs): the ones scanned for leaked paths.
CALIBRATION_FILE = "calibration.json"
_SCANNED = ("README.md", "config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", CALIBRATION_FILE)


class HubPushError(DrafterTrainError):
    """The export cannot be pushed: offline mode, no credentials, or the Hub refused it."""


class ExportLeakError(DrafterTrainError):
    """A local path survived scrubbing; the export is withheld rather than published with it."""


@dataclass
class ExportResult:
    folder: Path
    checkpoint: Path
    url: Optional[str] = None


# ----------------------------------------------------------------------------------------------------------------
# Which checkpoint


def resolve_checkpoint(cfg: ExportConfig) -> Path:
    """The step folder to export (symlinks resolved), checked against its checksums (drafter/ and metrics.json, what
    the export reads); a one-line error says why there is none. A damaged one is refused, never swapped for another."""
    step_dir = _find_checkpoint(cfg)
    try:
        verify_checkpoint(step_dir, parts=("drafter", "metrics.json"))
    except CheckpointDamagedError as err:
        field = "export.checkpoint" if cfg.checkpoint else f"export.which={cfg.which}"
        raise CheckpointDamagedError(f"{field}: checkpoint {err}; export another checkpoint") from None
    return step_dir


def _find_checkpoint(cfg: ExportConfig) -> Path:
    if cfg.checkpoint:
        step_dir = Path(cfg.checkpoint).expanduser().resolve()
        if not (step_dir / "drafter").is_dir():
            raise ConfigError(f"export.checkpoint: {cfg.checkpoint} is not a checkpoint (no drafter/ folder in it; "
                              "for a run folder use export.run_dir)")
        return step_dir
    run_dir = Path(cfg.run_dir).expanduser()
    if not run_dir.is_dir():
        raise ConfigError(f"export.run_dir: {cfg.run_dir}: no such folder")
    step_dir = run_dir / cfg.which
    if not (step_dir / "drafter").is_dir():
        raise ConfigError(f"export.which={cfg.which}: {_missing_reason(run_dir, cfg.which)}")
    return step_dir.resolve()


def _missing_reason(run_dir: Path, which: str) -> str:
    steps = step_dirs(run_dir)
    if not steps:
        return f"{run_dir} has no checkpoints yet (is it a drafter-train run folder?)"
    kept = ", ".join(p.name for p in steps)
    if which == "best":
        return f"{run_dir} has no best checkpoint yet (kept: {kept}); use export.which=latest or step-N"
    return f"no such checkpoint in {run_dir} (kept: {kept})"


# ----------------------------------------------------------------------------------------------------------------
# Keeping this machine out of the export


def scrub(value, recursive: bool = True):
    """Drop load-time keys and local-path strings from a JSON value (top level only when recursive=False)."""
    if isinstance(value, dict):
        return {k: scrub(v) if recursive else v for k, v in value.items()
                if k not in _LOAD_TIME_KEYS and not (isinstance(v, str) and looks_local(v))}
    if isinstance(value, list) and recursive:
        return [scrub(v) for v in value if not (isinstance(v, str) and looks_local(v))]
    return value


def _local_strings(value) -> set[str]:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return set().union(set(), *map(_local_strings, value))
    return {value} if isinstance(value, str) and looks_local(value) else set()


def check_no_leaks(folder: Path, needles: set[str]) -> None:
    """Refuse an export whose card or configs still name a local path (a publishing accident is not undoable).

    Vocabulary files (tokenizer.json, vocab.json, merges.txt) are not scanned: their entries are tokens, and a code
    vocabulary may well hold "/home" or "/root" as one.
    """
    needles = {n for n in needles if len(n.strip("/")) > 1}  # "/" alone would match every URL
    for name in _SCANNED:
        path = folder / name
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found = next((n for n in needles if n in text), None)
        if found is not None:
            raise ExportLeakError(f"{path.name} still contains the local path {found!r}; nothing was exported")


# ----------------------------------------------------------------------------------------------------------------
# Writing the folder


def copy_drafter(step_dir: Path, out: Path, draft_len: int, hf_assistant: bool = True, weights: bool = True) -> None:
    """Weights, config and tokenizer files of the checkpoint's drafter/, configs scrubbed, generation config set
    for drafters transformers' assisted generation can drive (not for Spec-Drafters or EAGLE-3 heads). weights=False:
    a kind whose folders hold settings only (layer skipping)."""
    src = step_dir / "drafter"
    if weights and not list(src.glob("*.safetensors")):
        raise ConfigError(f"export.checkpoint: {src} has no .safetensors weights")
    out.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        if path.is_file():
            shutil.copyfile(path, out / path.name)
    _rewrite_json(out / "config.json", scrub)
    _rewrite_json(out / "tokenizer_config.json", lambda d: scrub(d, recursive=False))  # added tokens stay intact
    if hf_assistant:
        write_generation_config(out / "generation_config.json", draft_len)


def write_format(fmt: str, info: RunInfo, out: Path, target_hub: str, gguf: Optional[GgufJob] = None) -> None:
    """The checkpoint's drafter in `fmt`. A drafter transformers can drive as a plain model (the AR kind) is served
    by vLLM and SGLang as that same folder (vLLM `draft_model`, SGLang's standalone drafter); other formats and kinds
    are written by the kind (drafters/<kind>/export.py; gguf writers also take the llama.cpp job)."""
    if fmt == "hf" or (info.kind.hf_assistant and fmt not in info.kind.export_formats):
        copy_drafter(info.step_dir, out, info.draft_len, info.kind.hf_assistant, info.kind.has_weights)
        return
    check_format(fmt, info)
    keep_embeddings = not info.config.get("drafter", {}).get("freeze_embeddings", True)
    extra = {"job": gguf} if fmt == "gguf" else {}
    info.kind.export_formats[fmt](info.step_dir / "drafter", out, info.draft_len, target_hub, keep_embeddings, **extra)
    copy_tokenizer(info.step_dir / "drafter", out)


def check_format(fmt: str, info: RunInfo) -> None:
    if fmt not in info.kind.export_formats:
        known = ", ".join(["hf", *info.kind.export_formats])
        raise ConfigError(f"export.format={fmt}: not available for {info.kind.description} (formats: {known})")


def copy_tokenizer(src: Path, out: Path) -> None:
    """The tokenizer files next to a drafter (scrubbed like copy_drafter's), for engine-format folders."""
    for path in sorted(src.iterdir()):
        if path.is_file() and (path.name.startswith(("tokenizer", "special_tokens")) or path.suffix == ".jinja"):
            shutil.copyfile(path, out / path.name)
    _rewrite_json(out / "tokenizer_config.json", lambda d: scrub(d, recursive=False))


def _rewrite_json(path: Path, fix) -> None:
    if path.is_file():
        path.write_text(json.dumps(fix(json.loads(path.read_text())), indent=2, ensure_ascii=False) + "\n")


def write_generation_config(path: Path, draft_len: int) -> None:
    """HF assisted generation drafts exactly the trained draft length, like the evaluator that measured it.

    The confidence early stop (default 0.4) would cut blocks short of what the drafter was trained and measured for.
    """
    config = scrub(json.loads(path.read_text())) if path.is_file() else {}
    config.pop("_from_model_config", None)  # it is edited now, not derived from config.json
    config.update(num_assistant_tokens=draft_len, num_assistant_tokens_schedule="constant",
                  assistant_confidence_threshold=0.0)
    path.write_text(json.dumps(config, indent=2) + "\n")


def prepare_output(cfg: ExportConfig, step_dir: Path) -> Path:
    """The output folder, checked before any work: writable, and new or empty (or an earlier export to replace)."""
    out = Path(cfg.output_dir).expanduser().absolute()
    if step_dir.is_relative_to(out.resolve()):
        raise ConfigError(f"export.output_dir: {cfg.output_dir} contains the checkpoint being exported")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export.output_dir: {cfg.output_dir} is a file")
    if out.is_dir() and any(out.iterdir()):
        if not cfg.overwrite:
            raise ConfigError(f"export.output_dir: {cfg.output_dir} is not empty (set export.overwrite=true to "
                              "replace an earlier export)")
        if MARKER not in _read(out / "README.md"):
            raise ConfigError(f"export.output_dir: {cfg.output_dir} is not an earlier drafter-export folder; "
                              "refusing to delete it")
    _check_writable(out.parent, cfg.output_dir)
    return out


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _check_writable(parent: Path, given: str) -> None:
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = parent / f".drafter-export-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"export.output_dir: cannot write {given}: {err.strerror}") from None


def _move_into_place(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)  # empty, or an earlier export (checked by prepare_output)
    os.replace(tmp, out)


# ----------------------------------------------------------------------------------------------------------------
# Hub


def check_can_push() -> None:
    """Fail in one line, before any upload, when pushing cannot work (offline mode, no or bad credentials)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import LocalTokenNotFoundError

    if constants.HF_HUB_OFFLINE:  # read once at import by huggingface_hub; every call would raise anyway
        raise HubPushError("export.push: HF_HUB_OFFLINE is set; unset it to push, or upload the folder later")
    try:
        HfApi().whoami()
    except LocalTokenNotFoundError:
        raise HubPushError("export.push: no Hub token; set HF_TOKEN or run `hf auth login`") from None
    except Exception as err:  # network down, token rejected...: any failure here means the upload cannot work
        raise HubPushError(f"export.push: cannot use the Hub ({type(err).__name__}: {_first_line(err)})") from None


def push_folder(folder: Path, repo_id: str, private: bool, message: str) -> str:
    """Create the repo if needed and upload the folder in one commit; returns the repo URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message=message)
    except Exception as err:  # HTTP errors, refused permissions, network: one line, the folder stays on disk
        raise HubPushError(f"export.push: upload to {repo_id} failed ({type(err).__name__}: {_first_line(err)}); "
                           f"the export is complete in {folder}") from None
    return str(url)


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0]


# ----------------------------------------------------------------------------------------------------------------
# Entry points


def export(cfg: ExportConfig) -> ExportResult:
    """Write the Hub-ready folder for the configured checkpoint; push it when asked. Fails before writing anything."""
    cfg.require_inputs()
    step_dir = resolve_checkpoint(cfg)
    info = read_run_info(step_dir)
    check_decoder_only(str(step_dir / "drafter"), "export.checkpoint")  # a seq2seq run: drafter-seq2seq's own export
    if info.config.get("target", {}).get("path"):
        check_decoder_only(str(info.config["target"]["path"]), "the run's target.path")
    info.calibration = read_calibration(cfg.calibration, step_dir / "drafter") if cfg.calibration else None
    out = prepare_output(cfg, step_dir)
    gguf = gguf_job(cfg, info) if cfg.format == "gguf" else None
    if cfg.push:
        check_can_push()  # before writing: offline or logged out, nothing is done
    tmp = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed export
    try:
        write_format(cfg.format, info, tmp, target_names(info, cfg.target_id)[2], gguf)
        (tmp / "README.md").write_text(model_card(info, cfg.repo_id or f"path/to/{out.name}", cfg.target_id,
                                                  cfg.format))
        if info.calibration is not None:  # local paths (the drafter it was measured from, say) scrubbed
            (tmp / CALIBRATION_FILE).write_text(json.dumps(scrub(info.calibration), indent=2))
        check_no_leaks(tmp, _local_strings(info.config) | _local_inputs(cfg) | {str(step_dir.parent), str(out)})
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    url = push_folder(out, cfg.repo_id, cfg.private, f"drafter-export: step {step_text(info)}") if cfg.push else None
    return ExportResult(out, step_dir, url)


def gguf_job(cfg: ExportConfig, info: RunInfo) -> GgufJob:
    """The llama.cpp side of export.format=gguf: the llama.cpp folder (its tools are looked for when used, after the
    kind's own refusals) and the run's target as a local HF folder (the converter reads its vocabulary; gguf_target
    converts it)."""
    check_format(cfg.format, info)  # a kind without a gguf writer: refused before looking for llama.cpp
    target_dir = target_folder(info.config.get("target", {}), "export.format=gguf")
    return GgufJob(llamacpp_dir(cfg.llamacpp), target_dir, cfg.gguf_type, cfg.gguf_target, cfg.drafter_gguf_type,
                   cfg.verify_file)


def read_calibration(path: str, drafter_dir: Path) -> dict:
    """export.calibration: a calibration.json measured for this checkpoint's drafter (refused in one line if not)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"export.calibration: cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    if not isinstance(record, dict) or "pick" not in record or "machine" not in record:
        raise ConfigError(f"export.calibration: {path} is not a calibration.json of drafter-eval "
                          "eval.calibration.enabled=true")
    measured = Path(str(record.get("drafter", "")))
    if not measured.exists() or measured.resolve() != drafter_dir.resolve():
        raise ConfigError(f"export.calibration: {path} was measured for the drafter {record.get('drafter')!r}, not "
                          f"this checkpoint's ({drafter_dir})")
    return record


def _local_inputs(cfg: ExportConfig) -> set[str]:
    """This export's own paths, as given and absolute, and the home folder."""
    given = [p for p in (cfg.run_dir, cfg.checkpoint, cfg.output_dir, cfg.calibration) if p]
    return {str(Path.home())} | {str(Path(p).expanduser().absolute()) for p in given}


def command(job: ExportJobConfig) -> None:
    """drafter-export once recipes/cli.py has built the job (its checks are export's own)."""
    result = export(job.export)
    print(f"exported {result.checkpoint.name} to {result.folder}", file=sys.stderr)
    if result.url:
        print(f"pushed to {result.url}", file=sys.stderr)


def main() -> None:
    """drafter-export as `python -m drafter_train.recipes.export`, and for installs whose console script still names
    this function; the console script is recipes/cli.py's export_main."""
    export_main()


if __name__ == "__main__":
    main()
