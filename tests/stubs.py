"""Stub "models" with hand-written logits: a bigram table maps the previous token to next-token logits.

They plug into the real decoder (CachedLM calls them like HF models), so decoder tests can state exactly which
drafts must be accepted.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig


class BigramLM(torch.nn.Module):
    """logits(next | prefix) = table[last token of prefix]."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table.float()
        self.config = LlamaConfig(vocab_size=table.shape[0], num_hidden_layers=1, hidden_size=8,
                                  num_attention_heads=1, intermediate_size=8)

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0, **tree_inputs):
        # a bigram's next token depends on the last token only: tree masks and positions change nothing
        logits = self.table[input_ids]  # [1, n, V]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


def cycle_table(vocab: int, step: int, scale: float = 10.0) -> torch.Tensor:
    """Greedy successor of x is (x + step) % vocab."""
    table = torch.zeros(vocab, vocab)
    table[torch.arange(vocab), (torch.arange(vocab) + step) % vocab] = scale
    return table


def greedy_table(successor: dict[int, int], vocab: int, scale: float = 10.0) -> torch.Tensor:
    table = torch.zeros(vocab, vocab)
    for x, y in successor.items():
        table[x, y] = scale
    return table


WORDS = "the a cat dog sat ran on mat and big small red blue house tree sun day night happy sad".split()
SPECIALS = ["<unk>", "<s>", "</s>"]


def word_tokenizer(words=WORDS):
    """Word-level tokenizer that adds BOS like Llama's, with no pad token and no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(words))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def run_cli(script: str, *args: str, cwd, env: dict | None = None):
    """Run console script `script` (drafter-train ...) as pyproject.toml's [project.scripts] defines it, from this
    checkout, in a fresh interpreter, offline, and capture its output (`env`: added to the environment)."""
    import os
    import subprocess
    import sys
    import tomllib

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts[script].split(":")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", **(env or {})}
    cmd = [sys.executable, "-c", f"from {module} import {function}; {function}()", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


VOCAB = len(SPECIALS) + len(WORDS)
SENTENCES = ["the cat sat on the mat", "a big dog ran", "the red sun", "small blue house and tree", "happy day"]


def compose_cfg(name: str, overrides: list[str], return_hydra_config: bool = False):
    """A composed (not yet validated) config of one of the entry points, as the CLI would build it (with its
    `hydra` node if asked: callbacks, sweep folder)."""
    from hydra import compose, initialize_config_dir

    from drafter_train.config import CONF_DIR
    from drafter_train.recipes.cli import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(name, overrides=overrides, return_hydra_config=return_hydra_config)


def engine_eval(engine: str, target: Path, drafter: Path, prompts: Path, output: Path) -> dict:
    """drafter-eval eval.engine=<engine> on `drafter` (a checkpoint's drafter folder) over 6 prompts of `prompts`,
    32 tokens, draft length 2: the metrics' `engine` record."""
    from omegaconf import OmegaConf

    from drafter_train.recipes.evaluate import run_eval_job

    return run_eval_job(OmegaConf.to_object(compose_cfg("eval", [
        f"target.path={target}", "target.chat_template=false", "drafter=path", f"drafter.path={drafter}",
        f"eval.prompts={prompts}", "eval.num_prompts=6", "eval.max_new_tokens=32", "eval.draft_len=2",
        "eval.baseline_kernels=same", f"eval.engine={engine}", f"eval.output={output / 'metrics.json'}"])))["engine"]


def save_tiny(model, folder, tokenizer=None) -> None:
    """A model folder the loaders accept: weights + config + `tokenizer` (default: the word tokenizer)."""
    model.save_pretrained(folder)
    (tokenizer or word_tokenizer()).save_pretrained(folder)


@torch.inference_mode()
def naive_greedy_speculative(target, propose, prompt: list[int], draft_len: int, max_new_tokens: int, eos=()):
    """A reference for the counts of greedy speculative decoding, with no cache and no shared code: every target
    prediction is the argmax of a full forward over the whole sequence. `propose(seq, k)` -> up to k draft ids.
    Returns (tokens, target_forward_passes, proposed, accepted) as the decoder's stats should count them."""
    def greedy_after(ids: list[int]) -> list[int]:  # the target's argmax after each position
        return target(torch.tensor([ids])).logits[0].argmax(-1).tolist()

    seq = list(prompt) + greedy_after(prompt)[-1:]
    tokens, passes, proposed, accepted = seq[len(prompt):], 1, 0, 0
    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
        k = min(draft_len, max_new_tokens - len(tokens) - 1)
        drafts = list(propose(seq, k))[:k] if k else []
        predicted = greedy_after(seq + drafts)[len(seq) - 1:]  # [len(drafts) + 1] target tokens
        n = 0
        while n < len(drafts) and drafts[n] == predicted[n]:
            n += 1
        passes, proposed, accepted = passes + 1, proposed + len(drafts), accepted + n
        new = drafts[:n] + [predicted[n]]
        seq += new
        stop = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        tokens += new[:stop]
    return tokens, passes, proposed, accepted


def greedy_drafts(drafter):
    """`propose(seq, k)` for naive_greedy_speculative: the drafter model's k greedy tokens, each a full forward."""
    @torch.inference_mode()
    def propose(seq: list[int], k: int) -> list[int]:
        drafts = []
        for _ in range(k):
            drafts.append(int(drafter(torch.tensor([seq + drafts])).logits[0, -1].argmax()))
        return drafts
    return propose
