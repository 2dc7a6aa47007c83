"""docs/add-a-drafter.md, proven: a drafter kind defined here, in a test module, registers itself and then trains,
evaluates (losslessly) and exports through the unchanged entry points; nothing else in the project is edited.

The toy kind is a bigram drafter: a learned [V, V] table of next-token logits given the last token."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from drafter_train.config import DrafterConfig, ExportConfig
from drafter_train.data.batches import Batch
from drafter_train.decoding.drafter import Proposal
from drafter_train.decoding.sampling import SamplingParams, choose_token
from drafter_train.drafters.common.distill import apply_loss, teacher_logits
from drafter_train.data.training_data import eval_prompt_ids
from drafter_train.drafters.registry import (BuildContext, DrafterKind, all_kinds, folder_kind, get_kind, kind_names,
                                             kind_schemas, make_drafter, register)
from drafter_train.evaluation import evaluate_decoding
from drafter_train.recipes.export import export
from drafter_train.recipes.train import train
from drafter_train.targets import eos_token_ids, load_target
from tests.stubs import compose_cfg

MODEL_TYPE = "toy_bigram_drafter"


@dataclass
class ToyBigramConfig(DrafterConfig):
    """drafter=toy_bigram_schema: the toy kind's own typed config."""

    kind: str = "toy_bigram"
    path: str = "new"
    init_scale: float = 0.0
    freeze_embeddings: bool = False  # it has no embeddings or LM head to freeze
    freeze_lm_head: bool = False


class BigramConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size: int = 8, **kwargs):
        self.vocab_size = vocab_size
        super().__init__(**kwargs)


class BigramModel(PreTrainedModel):
    config_class = BigramConfig
    base_model_prefix = "bigram"

    def __init__(self, config: BigramConfig):
        super().__init__(config)
        self.table = nn.Parameter(torch.zeros(config.vocab_size, config.vocab_size))
        self.post_init()

    def _init_weights(self, module):
        pass

    def forward(self, last_tokens: Tensor) -> Tensor:
        return self.table[last_tokens]


class BigramDrafter:
    """Decoder side: a chain of draft_len tokens, each from the table row of the token before it."""

    feature_layers = ()
    draft_ids: Optional[Tensor] = None

    def __init__(self, model: BigramModel):
        self.model = model

    def reset(self) -> None:
        pass

    def propose(self, seq: Tensor, draft_len: int, params: SamplingParams, generator) -> Proposal:
        token, tokens, probs = seq[-1], [], []
        for _ in range(draft_len):
            token, q = choose_token(self.model(token.view(1))[0].float(), params, generator)
            tokens.append(token)
            probs.append(q)
        return Proposal(torch.stack(tokens), None if params.greedy else torch.stack(probs))

    def commit(self, num_valid: int, features=None, path=None) -> None:
        pass


def build(cfg: ToyBigramConfig, ctx: BuildContext) -> BigramModel:
    if cfg.path != "new":
        return load(cfg.path, ctx.dtype)
    model = BigramModel(BigramConfig(vocab_size=ctx.target.config.vocab_size))
    nn.init.normal_(model.table, std=cfg.init_scale) if cfg.init_scale else None
    return model.to(ctx.target.device)


def load(path: str, dtype: str) -> BigramModel:
    return BigramModel.from_pretrained(path).eval()


def loss(module: BigramModel, target, batch: Batch, cfg):
    last = torch.gather(batch.input_ids, 1, batch.resp_pos)  # the token each response position is predicted from
    return apply_loss(cfg.loss, module(last), batch.labels, batch.resp_mask,
                      lambda: teacher_logits(target, batch, cfg.loss), cfg.drafter.draft_len)


@pytest.fixture(scope="module")
def toy_kind():
    AutoConfig.register(MODEL_TYPE, BigramConfig, exist_ok=True)
    AutoModel.register(BigramConfig, BigramModel, exist_ok=True)
    return register(DrafterKind(name="toy_bigram", description="a toy bigram drafter", model_type=MODEL_TYPE,
                                config_class=ToyBigramConfig, build=build, load=load,
                                decoder_drafter=BigramDrafter, loss=loss, summary="A bigram table."))


def test_a_kind_defined_outside_the_package_trains_evaluates_and_exports(toy_kind, tiny_data, tmp_path):
    assert get_kind("toy_bigram") is toy_kind and "toy_bigram" in kind_names() and "eagle3" in kind_names()
    # what the console scripts register with Hydra before any model module loads: every kind's own config
    assert kind_schemas() == {kind.name: kind.config_class for kind in all_kinds()}
    cfg = OmegaConf.to_object(compose_cfg("train", [
        f"target.path={tiny_data / 'target'}", "target.chat_template=false", "drafter=toy_bigram_schema",
        "drafter.draft_len=2", "loss=fkl", f"train.data_dir={tiny_data / 'data'}", f"train.output_root={tmp_path}",
        "train.run_name=toy", "train.max_steps=30", "train.batch_size=8", "train.save_every=30", "train.log_every=1",
        "train.lr=0.1", "train.warmup_steps=0", "eval.num_prompts=2", "eval.max_new_tokens=12", "eval.warmup=0",
    ]))
    assert isinstance(cfg.drafter, ToyBigramConfig)
    metrics = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "toy" / "metrics.jsonl").read_text().splitlines()]
    loss_by_step = [r["train/loss"] for r in rows if "train/loss" in r]
    assert loss_by_step[-1] < 0.8 * loss_by_step[0]  # the table learned the target's next-token distribution
    # The trainer's checkpoint evaluation ran the built-in speculative decoder with this kind's drafter and
    # accepted some of its drafts (a zero table would propose token 0 and be rejected nearly always).
    assert metrics["tau"] > 1.0 and metrics["acceptance_rate"] > 0.0

    # The saved folder loads back as this kind, and greedy speculative decoding with it equals plain decoding.
    saved = tmp_path / "toy" / "latest" / "drafter"
    assert json.loads((saved / "config.json").read_text())["model_type"] == MODEL_TYPE
    assert folder_kind(str(saved)) is toy_kind
    target, tokenizer = load_target(cfg.target)
    drafter = make_drafter(load(str(saved), "float32"), "default")
    prompts, _ = eval_prompt_ids(cfg, tokenizer)
    ev = evaluate_decoding(target, drafter, prompts, cfg.eval, eos_token_ids(target, tokenizer), progress=False)
    assert ev["greedy_match"] == 1.0 and ev["tau"] > 1.0

    # drafter-export writes the project's HF folder for it, with a model card naming the kind.
    result = export(ExportConfig(run_dir=str(tmp_path / "toy"), output_dir=str(tmp_path / "export")))
    assert (result.folder / "model.safetensors").is_file()
    assert "bigram" in (result.folder / "README.md").read_text().lower()
