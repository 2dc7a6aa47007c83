"""speculators 0.9.0's EAGLE-3 trainer on CPU, driven from outside (run by .venv-speculators' python; this project
is not importable there). Never edits speculators' installed sources: the CPU shims below patch names in its modules
from this process, each with the reason.

    python benchmarks/peers/speculators_train.py --target DIR --data rows.jsonl --layer-ids 3,16,27 --out DIR [...]

rows.jsonl: one {"input_ids", "loss_mask"} per line (prompt + response ids; 1 on response tokens), exactly what
`speculators prepare-data` makes. The hidden states speculators gets from vLLM come from HF forward hooks here, in
its layout: the INPUTS of the chosen layers (its `--target-layer-ids`, vLLM's convention) and the last layer's
output before the final norm. Its own pieces do the rest: vocabulary mapping from token frequencies, the
Eagle3DraftModel, its packing data loader and collate, its Trainer (optimizer, scheduler, TTT, loss).
Writes OUT/drafter (speculators' save_pretrained: the format vLLM loads) and OUT/train_info.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch


def cpu_shims() -> None:
    """speculators' Trainer assumes an accelerator; on a CPU-only machine three spots fail."""
    import speculators.train.trainer as trainer

    # Trainer.setup_model and the batch copy call `.to(self.local_rank)`: rank 0 means cuda:0. Name the CPU instead.
    trainer.get_local_rank = lambda: "cpu"
    # The step timer calls torch.accelerator.synchronize(), which raises without an accelerator: nothing to wait for.
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *args, **kwargs: None


def read_rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"input_ids": torch.tensor(r["input_ids"], dtype=torch.long),
             "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.long)} for r in rows]


@torch.no_grad()
def hidden_states(target, rows: list[dict], layer_ids: list[int]) -> list[dict]:
    """Per row {hidden_states [T, n, H] (inputs of layer_ids, an id equal to the layer count: the last output),
    last [T, H] (the last layer's output before the final norm)}: what speculators' vLLM hook writes."""
    layers = target.model.layers
    captured: dict = {}
    hooks = [layers[i].register_forward_pre_hook(
        lambda m, args, kwargs, i=i: captured.__setitem__(i, (kwargs.get("hidden_states", args[0] if args else None))),
        with_kwargs=True) for i in layer_ids if i < len(layers)]
    hooks.append(layers[-1].register_forward_hook(
        lambda m, args, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out)))
    try:
        out = []
        for row in rows:
            target.model(input_ids=row["input_ids"][None])
            last = captured["last"][0].float()
            feats = [captured[i][0].float() if i in captured else last for i in layer_ids]
            out.append({"hidden_states": torch.stack(feats, dim=1), "last": last})
    finally:
        for hook in hooks:
            hook.remove()
    return out


def draft_mapping(rows: list[dict], size: int, vocab: int):
    """speculators' own d2t/t2d from the response tokens' frequencies (prepare-data's token_freq.pt); None, None for
    the full vocabulary."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if not 0 < size < vocab:
        return None, None
    counts = Counter()
    for row in rows:
        counts.update(row["input_ids"][row["loss_mask"].bool()].tolist())
    return build_vocab_mappings_from_distribution(dict(counts), size, vocab)


def dataset(rows: list[dict], states: list[dict], max_len: int, dtype):
    """speculators' BaseDataset over the rows and their hidden states (its offline dataset reads them from disk)."""
    from speculators.train.data import BaseDataset

    class Rows(BaseDataset):
        def _compute_approx_lengths(self):
            return [min(len(r["input_ids"]), max_len) for r in rows]

        def _get_raw_data(self, index):
            hs = states[index]
            return {"hidden_states": hs["hidden_states"].flatten(1).to(dtype), "input_ids": rows[index]["input_ids"],
                    "verifier_last_hidden_states": hs["last"].to(dtype), "loss_mask": rows[index]["loss_mask"]}

        def __len__(self):
            return len(rows)

    return Rows(max_len, dtype)


@torch.no_grad()
def save_check(model, data, shift_batch, rows: int, ttt_steps: int, out: Path) -> None:
    """Its own forward's greedy drafts per TTT step on the first rows (teacher-forced, as in training), with the
    inputs, for a numerical check of this folder loaded elsewhere (tests/test_peer_trainers.py)."""
    model.eval()
    checks = []
    for index in range(min(rows, len(data))):
        item = shift_batch(data[index])
        length = item["input_ids"].shape[0]
        drafts = model(hidden_states=item["hidden_states"][None], input_ids=item["input_ids"][None],
                       document_ids=torch.zeros(1, length, dtype=torch.long),
                       position_ids=item["position_ids"][None], ttt_steps=ttt_steps)
        checks.append({"input_ids": data[index]["input_ids"], "draft_tokens": torch.cat(drafts)})
    torch.save(checks, out)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--layer-ids", required=True, help="speculators' ids: INPUTS of these target layers")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--draft-vocab-size", type=int, default=0, help="0: the target's whole vocabulary")
    p.add_argument("--total-seq-len", type=int, default=8192, help="tokens packed per step (its default 8192)")
    p.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--ttt-decay", type=float, default=1.0)
    p.add_argument("--loss-fn", default="kl_div")
    p.add_argument("--norm-before-fc", type=int, default=1)
    p.add_argument("--norm-output", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--scheduler", default="linear", choices=["linear", "cosine", "none"])
    p.add_argument("--sliding-window", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-states-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="its TrainerConfig.hidden_states_dtype: the autocast dtype of its training (its default "
                        "bfloat16, as vLLM hands it bf16 states); here also the target's hook forward's autocast")
    p.add_argument("--check-rows", type=int, default=0, help="save its greedy drafts on this many rows (check.pt)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    cpu_shims()
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    layer_ids = [int(i) for i in args.layer_ids.split(",")]
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    rows = read_rows(args.data)
    started = time.perf_counter()
    precision = getattr(torch, args.hidden_states_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == torch.bfloat16):
        states = hidden_states(target, rows, layer_ids)
    features_s = time.perf_counter() - started
    vocab = target.config.vocab_size
    d2t, t2d = draft_mapping(rows, args.draft_vocab_size, vocab)
    del target
    verifier = AutoConfig.from_pretrained(args.target)
    # its CLI's draft layer: one llama layer shaped from the verifier, sliding window 2048 (its defaults)
    layer = create_transformer_layer_config(args.target, num_layers=1, draft_arch="llama", hidden_act=None,
                                            sliding_window=args.sliding_window, full_attention_indices=[])
    model = Eagle3DraftModel.from_training_args(
        layer, t2d=t2d, d2t=d2t, draft_vocab_size=d2t.numel() if d2t is not None else vocab,
        norm_before_residual=False, norm_before_fc=bool(args.norm_before_fc), norm_output=bool(args.norm_output),
        ttt_steps=args.ttt_steps, verifier_name_or_path=args.target, target_layer_ids=layer_ids,
        draft_attn_impl="sdpa")  # flex attention has no CPU backward
    # the eager loss: the fused one is a Triton kernel
    loss = resolve_loss_config(args.loss_fn, "eager")
    calls = {"ttt_steps": args.ttt_steps, "ttt_step_loss_decay": args.ttt_decay, "loss_config": loss}
    data = dataset(rows, states, args.total_seq_len, torch.float32)
    loader = _setup_dataloader(data, args.total_seq_len, verifier.hidden_size, num_workers=0,
                               num_target_layers=len(layer_ids), prefetch_factor=None, preprocess=shift_batch,
                               seed=args.seed)
    config = TrainerConfig(lr=args.lr, num_epochs=args.epochs, save_path=str(args.out / "checkpoints"),
                           train_call_kwargs=calls, val_call_kwargs=calls, optimizer=args.optimizer,
                           scheduler_type=args.scheduler, hidden_states_dtype=precision, log_freq=1,
                           max_steps=args.max_steps, checkpoint_freq=args.epochs)
    trainer = Trainer(model, config, loader, None)
    # its autocast names "cuda" when no accelerator is found: autocast on the CPU (float32: a no-op; bfloat16: its
    # GPU default, on the CPU's bf16 units)
    trainer.device_type = "cpu"
    # the dtype its layers really computed in (what the precision option did, not what it was asked): its first linear
    computed: set[str] = set()
    first_linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    hook = first_linear.register_forward_hook(lambda m, i, out: computed.add(str(out.dtype).removeprefix("torch.")))
    started = time.perf_counter()
    trainer.run_training()
    train_s = time.perf_counter() - started
    hook.remove()
    model.save_pretrained(str(args.out / "drafter"))
    if args.check_rows:
        save_check(model, data, shift_batch, args.check_rows, args.ttt_steps, args.out / "check.pt")
    steps = getattr(trainer, "global_step", None)
    tokens = sum(int(r["loss_mask"].sum()) for r in rows) * args.epochs
    (args.out / "train_info.json").write_text(json.dumps({
        "trainer": "speculators", "version": "0.9.0", "optimizer_steps": steps, "train_wall_s": train_s,
        "features_wall_s": features_s, "response_tokens_seen": tokens, "computed_in": sorted(computed),
        "settings": vars(args) | {
            "data": str(args.data), "out": str(args.out)}}, indent=2))


if __name__ == "__main__":
    main()
