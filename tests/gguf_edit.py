"""Broken copies of a GGUF file, written with the gguf package: what the llama.cpp engine check must catch (wrong
layer ids, a shuffled d2t, random weights, a dropped norm). The writers are the package's own (gguf_file)."""

from drafter_train.gguf_file import rewrite_gguf, save_gguf

__all__ = ["rewrite_gguf", "save_gguf"]
