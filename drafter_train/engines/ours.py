"""This project's own decoder as an engine: the target in torch, the drafter as drafter-eval runs it.

- `OurDecoder`: the Engine interface (drafter-eval's decoder, one prompt at a time; the verify steps it reports are
  rebuilt from DecodeStats' histogram of accepted drafts, each step at the proposals' mean size).
- `Ours`: the engine table's decoders of ours (plain, prompt lookup, EAGLE-3 siblings, the AR drafter, the product)
  and HF generate, and our verify-cost curve.
"""

from __future__ import annotations

import time
from typing import Optional

from drafter_train.engines.base import Served
from drafter_train.errors import ConfigError


class OurDecoder:
    """The Engine interface over our decoder: greedy, one prompt at a time, decode time only (prefill included, as
    every engine here times it)."""

    name = "ours"

    def __init__(self, target, drafter, eval_cfg, eos):
        self.target, self.drafter, self.cfg, self.eos = target, drafter, eval_cfg, eos

    def decode(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool) -> Served:
        import dataclasses

        import torch

        from drafter_train.decoding.autoregressive import generate_autoregressive
        from drafter_train.evaluation import speculative_runner

        cfg = dataclasses.replace(self.cfg, max_new_tokens=max_new_tokens)
        run, new_stats = speculative_runner(self.target, self.drafter, cfg, self.eos)
        stats = new_stats()
        tokens, seconds = [], 0.0
        with torch.inference_mode():
            for prompt in prompts:
                began = time.perf_counter()
                if speculative:
                    result = run(prompt, cfg.seed)
                    stats.merge(result.stats)
                else:
                    result = generate_autoregressive(self.target, prompt, max_new_tokens, eos_token_ids=self.eos)
                seconds += time.perf_counter() - began
                tokens.append(list(result.tokens))
        steps = _steps(stats) if speculative else []
        return Served(tokens=tokens, tokens_per_s=sum(map(len, tokens)) / max(seconds, 1e-9), steps=steps,
                      draft_ms=1000 * stats.drafter_call_seconds)

    def close(self) -> None:
        """Nothing runs outside this process."""


OUR_DECODERS = ("plain", "free n-gram", "EAGLE-3", "AR drafter", "product")  # Ours' rows, by name


class Ours:
    """The target (auto kernels), its prompts, and every decoder of ours, ready to time one prompt set each."""

    def __init__(self, target: str, drafter: str, corpus: Optional[str], prompts: Optional[str], num_prompts: int,
                 draft_len: int, max_new_tokens: int, threads: int, ar_drafter: Optional[str] = None,
                 categories: Optional[list[str]] = None, prompt_set: Optional[list[list[int]]] = None,
                 only: Optional[list[str]] = None):
        """prompt_set: these prompts' token ids (the served table's, kept by category) instead of the first
        `num_prompts` of `prompts`; only: the decoders to run (plain always runs: every row divides by it)."""
        import torch

        from drafter_train.config import CorpusLookupConfig, DrafterConfig, EvalConfig, LookupConfig, TargetConfig, \
            TreeConfig
        from drafter_train.decoding.lookup import lookup_first
        from drafter_train.cpu_kernels import kernel_states
        from drafter_train.drafters.common.loading import load_drafter
        from drafter_train.drafters.ngram.config import NgramDrafterConfig
        from drafter_train.drafters.registry import make_drafter
        from drafter_train.data.prompts import prompt_ids
        from drafter_train.targets import eos_token_ids, load_target

        target_cfg = TargetConfig(path=target)
        self.target, self.tokenizer = load_target(target_cfg)
        self.eos = eos_token_ids(self.target, self.tokenizer)
        self.prompts = [list(p) for p in prompt_set] if prompt_set is not None else \
            prompt_ids(self.tokenizer, target_cfg, prompts, num_prompts, categories)[0]
        self.states = kernel_states(self.target, "auto", ("auto", "default"))
        k = draft_len
        siblings = TreeConfig(top_k=k, depth=1, total_tokens=k)
        base = EvalConfig(draft_len=k, max_new_tokens=max_new_tokens)
        lookups = LookupConfig(min_ngram=2, corpus=CorpusLookupConfig(path=corpus))
        eagle3 = make_drafter(load_drafter(DrafterConfig(path=drafter), self.target, self.tokenizer, "float32"))
        ngram = make_drafter(load_drafter(NgramDrafterConfig(min_ngram=2), self.target, self.tokenizer, "float32"))
        ar = None if not ar_drafter else make_drafter(
            load_drafter(DrafterConfig(path=ar_drafter), self.target, self.tokenizer, "float32"))
        torch.set_num_threads(threads)  # the same threads as llama.cpp's -t
        self.decoders = {"plain": None, "free n-gram": (ngram, base),
                         "EAGLE-3": (eagle3, EvalConfig(draft_len=k, max_new_tokens=max_new_tokens,
                                                        tree=siblings)),
                         **({"AR drafter": (ar, base)} if ar is not None else {}),
                         "product": (eagle3, EvalConfig(draft_len=k, max_new_tokens=max_new_tokens,
                                                        tree=siblings, lookup=lookups))}
        # lookups wrapped once: corpus lookup indexes its corpus when built
        self.decoders = {name: None if d is None else (lookup_first(d[0], d[1].lookup), d[1])
                         for name, d in self.decoders.items()}
        self.settings = {"plain": "target.cpu_kernels=auto", "free n-gram": "prompt lookup, min_ngram 2",
                         "EAGLE-3": f"top-{k} siblings", "AR drafter": f"chain of {k}",
                         "product": f"prompt lookup, corpus lookup, top-{k} siblings"}
        unknown = set(only or ()) - set(self.decoders)
        if unknown:  # a name of OUR_DECODERS this run has no drafter for (the AR drafter without --ar-drafter)
            raise ConfigError(f"our decoders: no {', '.join(sorted(unknown))} here (there are "
                              f"{', '.join(self.decoders)})")
        self.decoders = {name: d for name, d in self.decoders.items() if not only or name == "plain" or name in only}
        self.settings = {name: self.settings[name] for name in self.decoders}
        self.max_new_tokens = max_new_tokens

    def run(self, name: str) -> dict:
        """One decoder over every prompt: tokens/s (decode time only), and for speculation the steps it made; per
        prompt its tokens, ms and verify steps (accepted, drafted) (the served table's per-category figures, as
        llama-server's requests give them) and its output tokens (compared with plain's)."""
        import torch

        from drafter_train.cpu_kernels import apply_kernel_state
        from drafter_train.decoding.autoregressive import generate_autoregressive
        from drafter_train.evaluation import speculative_runner

        apply_kernel_state(self.target, self.states["auto"])
        if self.decoders[name] is None:
            def decode(prompt):
                return generate_autoregressive(self.target, prompt, self.max_new_tokens, eos_token_ids=self.eos)
            stats = None
        else:
            drafter, cfg = self.decoders[name]
            run, new_stats = speculative_runner(self.target, drafter, cfg, self.eos)
            stats = new_stats()

            def decode(prompt):
                return run(prompt, 0)
        decode(self.prompts[0])  # warm-up, not counted
        tokens, seconds, per_prompt, outputs = 0, 0.0, [], []
        with torch.inference_mode():
            for prompt in self.prompts:
                start = time.perf_counter()
                result = decode(prompt)
                took = time.perf_counter() - start
                seconds += took
                tokens += len(result.tokens)
                outputs.append(list(result.tokens))
                per_prompt.append({"tokens": len(result.tokens), "gen_ms": 1000 * took,
                                   "steps": [] if stats is None else _steps(result.stats)})
                if stats is not None:
                    stats.merge(result.stats)
        out = {"tokens_per_s": tokens / seconds, "tokens": tokens, "per_prompt": per_prompt, "outputs": outputs}
        if stats is not None:
            out.update(stats=stats, tree=self.decoders[name][1].tree.enabled)
        return out

    def hf_generate(self) -> dict:
        """HF generate, plain greedy, on transformers' own kernels (target.cpu_kernels=default)."""
        import torch

        from drafter_train.cpu_kernels import apply_kernel_state

        apply_kernel_state(self.target, self.states["default"])
        try:
            def decode(prompt):
                ids = torch.tensor([prompt])
                out = self.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                           max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                                           pad_token_id=self.eos[0])
                return out.shape[1] - len(prompt)
            decode(self.prompts[0])
            tokens, seconds = 0, 0.0
            for prompt in self.prompts:
                start = time.perf_counter()
                tokens += decode(prompt)
                seconds += time.perf_counter() - start
        finally:
            apply_kernel_state(self.target, self.states["auto"])
        return {"tokens_per_s": tokens / seconds, "tokens": tokens}

    def curve(self, sizes: list[int], tree_sizes: list[int], depth: int, repeats: int) -> dict:
        from drafter_train.calibrate import verify_cost_curve
        from drafter_train.cpu_kernels import apply_kernel_state

        apply_kernel_state(self.target, self.states["auto"])
        prefix = (list(self.prompts[0]) * (depth // max(len(self.prompts[0]), 1) + 1))[:depth]
        return verify_cost_curve(self.target, prefix, sizes, tree_sizes, repeats)


def _steps(stats) -> list[tuple[int, int]]:
    """A decode's verify steps as (accepted, drafted) pairs, each at the proposals' mean size (DecodeStats keeps a
    histogram of accepted drafts, not each step's size), as OurDecoder reports them."""
    size = round(stats.proposed / max(stats.proposals, 1))
    return [(a, size) for a, count in enumerate(stats.accepted_hist) for _ in range(count)]
