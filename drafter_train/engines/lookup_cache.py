"""A drafter-datagen folder's answers as llama.cpp's static n-gram cache: the corpus of corpus lookup, served by
llama.cpp's ngram-cache mode (the served table, the engine checks, the pipelines' corpus-lookup stage)."""

from __future__ import annotations

from pathlib import Path

from drafter_train.config import TargetConfig
from drafter_train.data.store import load_distill_dataset
from drafter_train.llamacpp import llamacpp_dir, run_tool, tool
from drafter_train.targets import load_target_tokenizer


def write_lookup_cache(root: Path, target_gguf: Path, corpus: Path, out: Path, tokenizer) -> Path:
    """A drafter-datagen folder's responses (the corpus our corpus lookup reads) as llama.cpp's static n-gram cache
    (llama-lookup-create; served with --spec-type ngram-cache --lookup-cache-static OUT). llama.cpp tokenizes text,
    so the responses go in decoded, one per paragraph."""
    create = tool(root, "llama-lookup-create", "--lookup-corpus")
    data = load_distill_dataset(corpus)
    texts = [tokenizer.decode(own or reference, skip_special_tokens=True)
             for own, reference in zip(data["response_ids"], data["reference_ids"])]
    text_file = out.with_suffix(".txt")
    text_file.write_text("\n\n".join(texts))
    run_tool([str(create), "-m", str(target_gguf), "-f", str(text_file), "-lcs", str(out)],
             f"llama-lookup-create on {corpus}")
    return out


def write_target_lookup_cache(target_gguf: str, corpus: str, out: str, target: str = "") -> Path:
    """write_lookup_cache with llama.cpp where llamacpp_dir() finds it and the tokenizer of `target` (a target.path,
    e.g. embedded:qwen2.5-coder-1.5b; empty: the default target), for a pipeline stage (conf/pipeline/*.yaml)."""
    tokenizer = load_target_tokenizer(TargetConfig(path=target) if target else TargetConfig())
    return write_lookup_cache(llamacpp_dir(), Path(target_gguf), Path(corpus), Path(out), tokenizer)
