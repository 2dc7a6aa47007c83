"""`drafter-datagen`: the target's own continuations of training prompts, for distilling a drafter.

Pipeline: prompt source (sources.py) -> eval/train split -> target generation by the chosen backend
(``datagen.backend``: hf = generation.py in this process, vllm = vllm_backend.py in a worker process, llamacpp =
llamacpp_backend.py on llama-server) -> resumable
shards on disk (store.py). ``run_datagen(cfg)`` is the importable entry point; ``main`` wraps it in Hydra.

    drafter-datagen target=stories260k datagen.num_prompts=16 datagen.output_dir=data/x

Consumers read the result with ``load_distill_dataset(dir)`` and ``load_eval_prompts(dir)``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, TypeVar

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from drafter_train.config import DatagenConfig, DatagenJobConfig
from drafter_train.recipes.cli import datagen_main
from drafter_train.devices import default_device
from drafter_train.distributed import bf16_pays
from drafter_train.machine import machine_info
from drafter_train.preflight import check_inputs
from drafter_train.data.chat import ChatTemplate
from drafter_train.data.conversations import (TrainConversation, conversation_record, open_conversations,
                                              select_conversations)
from drafter_train.data.generation import Continuation, HFBackend, ReferenceBackend
from drafter_train.data.regenerate import progress_path, regenerate
from drafter_train.data.sources import (Selection, TrainPrompt, exclusion_index, open_source, select_prompts,
                                        source_name)
from drafter_train.data.store import (FORMAT, SHARDS, DatagenStore, features, load_distill_dataset, load_eval_prompts,
                                      shard_name, tokenizer_fingerprint)
from drafter_train.data.llamacpp_backend import LlamaCppBackend
from drafter_train.data.vllm_backend import VllmBackend
from drafter_train.targets import (eos_token_ids, load_target, load_target_tokenizer, model_identity,
                                   target_eos_token_ids)

__all__ = ["run_datagen", "load_distill_dataset", "load_eval_prompts", "main"]
T = TypeVar("T")

# what open_backend returns: each generates for a shard, or (generate=false) only tokenizes
Backend = HFBackend | VllmBackend | LlamaCppBackend | ReferenceBackend


class Throughput:
    """Progress over training prompts, with generated tokens per second of generate() time as the postfix."""

    def __init__(self, total: int, done: int, enabled: bool):
        self.bar = tqdm(total=total, initial=done, desc="datagen", unit="prompt", disable=not enabled)
        self.tokens, self.seconds = 0, 0.0

    def update(self, prompts: int, tokens: int, seconds: float) -> None:
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        self.bar.update(prompts)
        self.bar.set_postfix({"tok/s": f"{self.tokens_per_s:.1f}"})

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_datagen(cfg: DatagenJobConfig, progress: bool = True) -> Path:
    """Generate (or finish generating) the dataset named by ``cfg``; returns the output folder."""
    dg = cfg.datagen
    store = DatagenStore.open(dg.output_dir)  # an unwritable folder fails before the target is loaded
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, dtype=generation_dtype(cfg, store.manifest)))
    settings = data_settings(cfg)
    store.check_settings(settings)
    # A missing or empty prompt file fails here, also before the target; so does a bad datagen.exclude file.
    source = open_conversations(dg) if dg.multi_turn else open_source(dg)
    exclude = exclusion_index(dg)
    check_inputs(cfg)  # the target's path, before it loads
    if dg.multi_turn:  # and its chat template
        ChatTemplate(load_target_tokenizer(cfg.target), [], dg.thinking)
    backend = open_backend(cfg)
    if dg.multi_turn:
        chat = ChatTemplate(backend.tokenizer, backend.eos_token_ids, dg.thinking)
        selection = select_conversations(source, chat, dg, exclude)
        make_shard = functools.partial(_conversation_shard, backend, chat, dg, store)
    else:
        selection = select_prompts(source, backend.tokenizer, dg, cfg.target.chat_template, exclude)
        make_shard = functools.partial(_prompt_shard, backend, dg)
    grown_from = store.grown_from(dg.num_prompts)  # a rerun with more prompts: the old ones must come first
    settings["prompts"]["sha256"] = selection.fingerprint(grown_from)
    store.check_settings(settings)  # same source name, different content: refuse too
    settings["prompts"]["sha256"] = selection.fingerprint()
    if grown_from is not None:
        store.redo_short_shards(len(selection.train), dg.shard_size, dg.samples_per_prompt)
    store.start(_manifest(cfg, settings, selection, backend), selection.eval_prompts)
    with backend:
        meter = _generate_missing_shards(selection.train, dg, store, progress, make_shard)
    store.manifest["run"].update(backend.run_info())  # what the backend chose as it ran (llama.cpp's slot count)
    store.finish()
    if progress:
        print(_summary(store, meter), file=sys.stderr)
    return store.root


def generation_dtype(cfg: DatagenJobConfig, manifest: Optional[dict]) -> str:
    """The target dtype the continuations are generated in (datagen.dtype): auto resumes a begun folder in its
    recorded dtype, else takes bfloat16 where it measures faster now (distributed.bf16_pays)."""
    dg = cfg.datagen
    if dg.dtype == "target" or not dg.generate or dg.backend == "llamacpp":  # llama-server runs the GGUF's own
        return cfg.target.dtype
    if dg.dtype != "auto":
        return dg.dtype
    if manifest is not None:
        return manifest["target"]["dtype"]
    pays, why = bf16_pays(default_device())
    print(f"drafter-datagen: datagen.dtype={'bfloat16' if pays else 'float32'} ({why})", file=sys.stderr)
    return "bfloat16" if pays else "float32"


def open_backend(cfg: DatagenJobConfig) -> Backend:
    """hf: loads the target into this process. vllm: reads only its tokenizer and configs here (the engine starts
    in a worker process when the first shard is generated, so a finished folder never starts it). generate=false,
    any backend: the tokenizer and configs alone (the source's answers are kept; a 1.5B target's fp32 copy would
    take minutes and 12 GB to load for nothing)."""
    if not cfg.datagen.generate:
        tokenizer = load_target_tokenizer(cfg.target)
        return ReferenceBackend(tokenizer, target_eos_token_ids(cfg.target, tokenizer))
    if cfg.datagen.backend == "vllm":
        return VllmBackend(cfg)
    if cfg.datagen.backend == "llamacpp":
        return LlamaCppBackend(cfg)
    model, tokenizer = load_target(cfg.target)
    eos = eos_token_ids(model, tokenizer)
    return HFBackend(model, tokenizer, cfg.datagen, eos, pad_id(tokenizer, eos))


def data_settings(cfg: DatagenJobConfig) -> dict:
    """What the data depends on; a rerun must match these to resume (batch_size is a speed knob, not compared:
    greedy results do not depend on it, sampled ones only through the random stream). The backend is compared:
    its kernels part from the other's at near-ties, so one folder holds one backend's continuations."""
    dg = cfg.datagen
    names = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "store_topk", "generate", "backend",
             "samples_per_prompt")  # folders written before it imply 1 (store.IMPLIED)
    generation = {k: getattr(dg, k) for k in names}
    prompts = {k: getattr(dg, k) for k in ("prompt_field", "response_field", "num_eval_prompts", "num_prompts")}
    prompts.update(source=source_name(dg), max_prompt_tokens=dg.max_prompt_tokens, shard_size=dg.shard_size)
    if dg.exclude:  # only when set: folders written before the option still resume
        prompts["exclude"] = list(dg.exclude)
    if dg.multi_turn:  # likewise: single-turn folders compare as before
        prompts.update(multi_turn=True, thinking=dg.thinking)
    if dg.later_parts:  # likewise: folders of first parts compare as before
        prompts["later_parts"] = True
    target = dict(model_identity(cfg.target), chat_template=cfg.target.chat_template)
    return {"format": FORMAT, "target": target, "generation": generation, "prompts": prompts}


def _manifest(cfg: DatagenJobConfig, settings: dict, selection: Selection, backend: Backend) -> dict:
    num_shards = -(-len(selection.train) // cfg.datagen.shard_size)
    counts = {"eval_prompts": len(selection.eval_prompts), "train_prompts": len(selection.train)}
    counts.update(skipped=selection.skipped, shards_total=num_shards)
    eos = backend.eos_token_ids
    run = {"batch_size": backend.batch_size, "eos_token_ids": eos, "pad_token_id": pad_id(backend.tokenizer, eos),
           "tokenizer_sha256": tokenizer_fingerprint(backend.tokenizer)}  # checked by whoever reads the token ids
    return dict(
        settings,
        counts=counts,
        run=dict(run, **backend.run_info()),
        machine=machine_info(default_device(), cfg.target.dtype),  # the latest run's: a resumed folder's last
        columns=list(features(cfg.datagen.store_topk, cfg.datagen.multi_turn)),
        complete=False,
        config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
    )


def _generate_missing_shards(train: list, dg: DatagenConfig, store: DatagenStore, progress: bool,
                             make_shard: Callable[[int, Sequence, Throughput], list[dict]]) -> Throughput:
    shards = list(_chunks(train, dg.shard_size))
    finished = store.finished_shards()
    done = sum(len(shard) for index, shard in enumerate(shards) if shard_name(index) in finished)
    meter = Throughput(len(train) * dg.samples_per_prompt, done * dg.samples_per_prompt, progress)  # answers
    for index, items in enumerate(shards):
        if shard_name(index) in finished:
            continue
        store.write_shard(index, make_shard(index, items, meter), dg.store_topk, dg.multi_turn)
    meter.bar.close()
    return meter


def _prompt_shard(backend: Backend, dg: DatagenConfig, index: int, prompts: Sequence[TrainPrompt],
                  meter: Throughput) -> list[dict]:
    # Seeded per shard, so a resumed run samples exactly what an uninterrupted one would have (the vLLM
    # backend seeds each prompt instead).
    torch.manual_seed(dg.seed + index)
    return generate_shard(backend, prompts, dg, meter)


def _conversation_shard(backend: Backend, chat: ChatTemplate, dg: DatagenConfig,
                        store: DatagenStore, index: int, convs: Sequence[TrainConversation],
                        meter: Throughput) -> list[dict]:
    """datagen.multi_turn: every assistant turn regenerated turn by turn (data/regenerate.py), resumable
    mid-conversation through the shard's progress file; generate=false keeps the source's answers."""
    if not dg.generate:
        meter.update(len(convs), 0, 0.0)
        return [conversation_record(chat, c, None, dg.max_prompt_tokens) for c in convs]
    progress = progress_path(store.root / SHARDS, index)
    dialogues = regenerate(backend, chat, convs, dg, index, progress, lambda n, s: meter.update(0, n, s))
    meter.update(len(convs), 0, 0.0)
    return [conversation_record(chat, d.conv, d.messages, dg.max_prompt_tokens, d.cut) for d in dialogues]


def generate_shard(
    backend: Backend, prompts: Sequence[TrainPrompt], dg: DatagenConfig, meter: Throughput
) -> list[dict]:
    """Records for one shard, in prompt order (datagen.samples_per_prompt records per prompt, side by side: each a
    row of its own in the sampled batch, so each draws its own answer); batches (backend.batch_size rows, None = the
    whole shard: vLLM batches on its own) are formed by prompt length to waste less on padding."""
    if not dg.generate:  # fixed responses only (train.response=reference): no target call at all
        return [_record(p, Continuation([]), 0) for p in prompts]
    prompts = [dataclasses.replace(p, sample=k) for p in prompts for k in range(dg.samples_per_prompt)]
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i].prompt_ids))
    continuations: list = [None] * len(prompts)
    for batch in _chunks(by_length, backend.batch_size or len(prompts)):
        outputs, seconds = backend.generate([prompts[i] for i in batch])
        meter.update(len(batch), sum(len(c.response_ids) for c in outputs), seconds)
        for i, continuation in zip(batch, outputs):
            continuations[i] = continuation
    return [_record(p, c, dg.store_topk) for p, c in zip(prompts, continuations)]


def _record(prompt: TrainPrompt, continuation: Continuation, store_topk: int) -> dict:
    record = {
        "prompt_index": prompt.index,
        "prompt": prompt.text,
        "prompt_ids": prompt.prompt_ids,
        "response_ids": continuation.response_ids,
        "reference_ids": prompt.reference_ids,
    }
    if store_topk:
        record.update(topk_ids=continuation.topk_ids, topk_logits=continuation.topk_logits)
    return record


def pad_id(tokenizer: PreTrainedTokenizerBase, eos: list[int]) -> int:
    """Any id works (padding is masked and cut away); load_tokenizer sets pad = EOS when the tokenizer has none."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return eos[0] if eos else 0


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _summary(store: DatagenStore, meter: Throughput) -> str:
    counts = store.manifest["counts"]
    shards = len(store.manifest["shards"])
    made = (f"{store.response_tokens()} response tokens ({meter.tokens} generated now at {meter.tokens_per_s:.1f} "
            f"tokens/s)" if store.manifest["generation"]["generate"] else
            f"{store.total('reference_tokens')} reference tokens (datagen.generate=false: the source's answers)")
    return (
        f"drafter-datagen: {counts['train_prompts']} training prompts in {shards}/{counts['shards_total']} shards, "
        f"{made}, {counts['eval_prompts']} eval prompts held out -> {store.root}"
        + (f"; {store.total('truncated_conversations')} conversations cut short by datagen.max_prompt_tokens "
           f"({store.total('dropped_turns')} assistant turns dropped), {store.total('cut_turns')} turns cut at "
           f"max_new_tokens" if is_multi_turn(store) else "")
    )


def is_multi_turn(store: DatagenStore) -> bool:
    return bool(store.manifest["prompts"].get("multi_turn"))


def command(job: DatagenJobConfig) -> None:
    """drafter-datagen once recipes/cli.py has checked the job."""
    run_datagen(job)


def main() -> None:
    """drafter-datagen as `python -m drafter_train.recipes.datagen`, and for installs whose console script still
    names this function; the console script is recipes/cli.py's datagen_main."""
    datagen_main()


if __name__ == "__main__":
    main()
