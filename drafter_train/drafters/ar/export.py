"""Stand-alone AR drafters in the formats serving engines load besides the HF folder (which vLLM and SGLang serve
as it is).

- `gguf`: a llama.cpp draft model (`-md drafter.gguf`, `--spec-type draft-simple`), converted from the saved folder
  by llama.cpp's own converter, in float or quantised by llama-quantize (export.drafter_gguf_type: a draft model's
  cost follows its bytes, and a Qwen-sized vocabulary's embedding and head dominate a small one); with it, the
  target in export.gguf_type.
"""

from __future__ import annotations

from pathlib import Path

from drafter_train.llamacpp import DRAFTER_FILE, GgufJob, convert_typed


def write_gguf(drafter_dir: Path, out: Path, draft_len: int, verifier: str, keep_embeddings: bool,
               job: GgufJob) -> None:
    out.mkdir(parents=True, exist_ok=True)
    convert_typed(job.root, drafter_dir, out / DRAFTER_FILE, job.drafter_type)
    job.write_target(out)


FORMATS = {"gguf": write_gguf}
