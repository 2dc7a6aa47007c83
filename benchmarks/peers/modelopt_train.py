"""nvidia-modelopt 0.47.0's EAGLE-3 training on CPU, driven through its Python API from outside (run by
.venv-modelopt's python; this project is not importable there). Its example trainer
(examples/speculative_decoding/main.py) is not in the wheel: this script does what that example does with
modelopt.torch.speculative (convert the target into an HFEagleModel, train online with the target in the same
process, export with its EagleExporter), using transformers' own Trainer. Never edits ModelOpt's installed sources.

    python benchmarks/peers/modelopt_train.py --target DIR --data rows.jsonl --layer-ids 2,14,26 --out DIR [...]

rows.jsonl: {"input_ids", "loss_mask"} per line, as for speculators. --layer-ids are ModelOpt's own: it hooks the
OUTPUTS of these layers (this project's convention) and exports the ids unchanged. Writes OUT/drafter (its export:
LlamaForCausalLMEagle3 with eagle_config, the layout this project's drafter=path loads as trained), OUT/drafter-vllm
(the same with the ids + 1: vLLM reads layer INPUTS, so ModelOpt's own folder is served one layer off) and
OUT/train_info.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch


def rows_dataset(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows]


class Collate:
    """input_ids / attention_mask / loss_mask right-padded to one fixed width (what HFEagleModel.forward reads;
    labels for its base loss, unused with the base frozen). Fixed: it caches its training-time-test attention masks
    by step only, built for the first batch's length (its example pads every row to training_seq_len too)."""

    def __init__(self, width: int):
        self.width = width

    def __call__(self, batch: list[dict]) -> dict:
        return collate(batch, self.width)


def collate(batch: list[dict], width: int) -> dict:
    def pad(values, fill):
        return torch.tensor([v[:width] + [fill] * (width - len(v[:width])) for v in values], dtype=torch.long)

    ids = pad([r["input_ids"] for r in batch], 0)
    return {"input_ids": ids, "attention_mask": pad([[1] * len(r["input_ids"]) for r in batch], 0),
            "loss_mask": pad([r["loss_mask"] for r in batch], 0), "labels": ids.clone()}


def eagle_config(args, target_config) -> dict:
    """ModelOpt's EAGLE3_DEFAULT_CFG with the run's layer ids and draft vocabulary; --match-target shapes the draft
    layer like the target's (its default is an 8B-sized layer: 32 heads of 128, MLP 14336)."""
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG

    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    arch = cfg["eagle_architecture_config"]
    arch["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in args.layer_ids.split(",")]
    if 0 < args.draft_vocab_size < target_config.vocab_size:
        arch["draft_vocab_size"] = args.draft_vocab_size
    if args.match_target:
        arch.update(intermediate_size=target_config.intermediate_size,
                    num_attention_heads=target_config.num_attention_heads,
                    num_key_value_heads=target_config.num_key_value_heads,
                    head_dim=getattr(target_config, "head_dim", None)
                    or target_config.hidden_size // target_config.num_attention_heads)
    arch["torch_dtype"] = "float32"
    cfg.update(eagle_ttt_steps=args.ttt_steps, eagle_loss_decay_factor=args.ttt_decay,
               # torch.compile of its eagle forward/loss: an inductor C++ build per shape on 2 CPU cores
               eagle_use_torch_compile=False)
    if not args.inject_yarn:
        cfg["eagle_export_rope_scaling"] = {}  # its documented switch: export the rope it trained with
    return cfg


def draft_vocab(model, rows: list[dict], size: int) -> None:
    """Its d2t buffer from the response tokens' frequencies (what its example's calibration writes)."""
    if not hasattr(model.eagle_module, "d2t"):
        return
    counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
    for r in rows:
        ids = torch.tensor(r["input_ids"])[torch.tensor(r["loss_mask"]).bool()]
        counts += torch.bincount(ids, minlength=counts.numel())
    chosen = torch.sort(torch.topk(counts, size).indices).values
    model.eagle_module.d2t.copy_(chosen - torch.arange(size))


def vllm_copy(drafter: Path, out: Path) -> None:
    """ModelOpt's export with its layer ids + 1 (vLLM reads the INPUT of layer i; ModelOpt hooked outputs)."""
    import shutil

    shutil.copytree(drafter, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    eagle = config["eagle_config"]
    eagle["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"]]
    (out / "config.json").write_text(json.dumps(config, indent=4))


# its example's settings where it has them (lr 1e-4, batch 1, cosine), else ModelOpt's EagleConfig defaults
OPTIONS = {
    "--target": dict(required=True), "--data": dict(type=Path, required=True),
    "--layer-ids": dict(required=True, help="ModelOpt's ids: OUTPUTS of these target layers"),
    "--out": dict(type=Path, required=True),
    "--draft-vocab-size": dict(type=int, default=0, help="0: the target's whole vocabulary"),
    "--seq-len": dict(type=int, default=512, help="every row padded or cut to this"),
    "--lr": dict(type=float, default=1e-4), "--batch-size": dict(type=int, default=1),
    "--ttt-steps": dict(type=int, default=3), "--ttt-decay": dict(type=float, default=0.8),
    "--epochs": dict(type=int, default=1), "--max-steps": dict(type=int, default=-1),
    "--scheduler": dict(default="cosine"), "--warmup-steps": dict(type=int, default=0),
    "--match-target": dict(type=int, default=0, help="1: the draft layer shaped like the target's"),
    "--inject-yarn": dict(type=int, default=1, help="its export's YaRN rope scaling (its default: on)"),
    "--seed": dict(type=int, default=0),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, options in OPTIONS.items():
        p.add_argument(flag, **options)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    import modelopt.torch.speculative as mtsp
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    rows = rows_dataset(args.data)
    mtsp.convert(model, [("eagle", eagle_config(args, model.config))])
    if 0 < args.draft_vocab_size < model.config.vocab_size:
        draft_vocab(model, rows, args.draft_vocab_size)
    training = TrainingArguments(
        output_dir=str(args.out / "trainer"), per_device_train_batch_size=args.batch_size, learning_rate=args.lr,
        num_train_epochs=args.epochs, max_steps=args.max_steps, lr_scheduler_type=args.scheduler,
        warmup_steps=args.warmup_steps, logging_steps=1, report_to=[], use_cpu=True, seed=args.seed,
        # no checkpoints: the export below is the result (and its example's make_dataclass training arguments,
        # not used here, fail to pickle at the first save on Python 3.11)
        save_strategy="no", remove_unused_columns=False, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training, train_dataset=rows, data_collator=Collate(args.seq_len))
    started = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - started
    model.eval()
    model.get_exporter().export(args.out / "drafter", torch.float32)
    vllm_copy(args.out / "drafter", args.out / "drafter-vllm")
    (args.out / "train_info.json").write_text(json.dumps({
        "trainer": "modelopt", "version": "0.47.0", "optimizer_steps": result.global_step, "train_wall_s": train_s,
        "response_tokens_seen": sum(sum(r["loss_mask"]) for r in rows) * args.epochs,
        "settings": vars(args) | {"data": str(args.data), "out": str(args.out)}}, indent=2))


if __name__ == "__main__":
    main()
