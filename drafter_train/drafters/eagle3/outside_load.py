"""An outside EAGLE-3 folder (outside.py: speculators' or ModelOpt's layout) as this project's Eagle3Model."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig
from safetensors.torch import load_file

from drafter_train import draft_vocab
from drafter_train.drafters.eagle3 import outside
from drafter_train.drafters.eagle3.export import _LAYER_KEYS
from drafter_train.errors import ConfigError
from drafter_train.drafters.eagle3.modeling import Eagle3Config, Eagle3Model


def eagle3_config(config: dict, which: str) -> Eagle3Config:
    """The Eagle3Config an outside config.json maps to (layer ids in this project's 'output of layer i')."""
    if which == outside.SPECULATORS:
        # speculators serialises the layer config as a diff against its class's defaults: fill them in
        layer = AutoConfig.for_model(**config["transformer_layer_config"]).to_dict()
        ids = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]  # input of layer i -> output of i - 1
        flags = dict(fc_norm=bool(config.get("fc_norm")), norm_before_fc=bool(config.get("norm_before_fc")),
                     norm_output=bool(config.get("norm_output")))
        target_hidden = config.get("target_hidden_size") or layer["hidden_size"]
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        draft_len = methods[0].get("speculative_tokens") or 3
    else:  # ModelOpt: the outputs of its layers, exported unchanged; no norm before fc; fc reads the draft width
        layer = {k: config[k] for k in _LAYER_KEYS if config.get(k) is not None}
        ids = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        flags = dict(fc_norm=False, norm_before_fc=False)
        target_hidden, draft_len = layer["hidden_size"], config.get("num_speculative_tokens") or 3
    layer.update(model_type="llama", num_hidden_layers=1)
    vocab = layer["vocab_size"]
    return Eagle3Config(backbone=layer, target_layers=ids, target_num_layers=max(ids) + 1,
                        target_hidden_size=target_hidden, draft_vocab_size=config.get("draft_vocab_size") or vocab,
                        draft_len=draft_len, vocab_size=vocab, tie_word_embeddings=False,
                        bos_token_id=layer.get("bos_token_id"), eos_token_id=layer.get("eos_token_id"), **flags)


def _mapping(weights: dict, rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): the folder's, t2d rebuilt from d2t where only d2t is written (ModelOpt), the identity for a
    full-vocabulary head (neither written)."""
    if "d2t" not in weights:
        return torch.zeros(rows, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    d2t = weights["d2t"].long()
    if "t2d" in weights:
        return d2t, weights["t2d"].bool()
    return draft_vocab.mapping(draft_vocab.draft_to_target(d2t), vocab)


def load(path: str, dtype: str) -> tuple[Eagle3Model, bool]:
    """(the drafter in eval mode without gradients, whether the folder held its own token embeddings: when not,
    the caller copies the target's, as the engines share them)."""
    outside.check_folder(path)
    raw = outside.read_config(path)
    config = eagle3_config(raw, outside.layout(raw))
    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(file))
    model = Eagle3Model(config)
    d2t, t2d = _mapping(weights, config.draft_vocab_size, config.vocab_size)
    draft_vocab.check_mapping(d2t, t2d, config.draft_vocab_size)
    config.draft_vocab_fingerprint = draft_vocab.fingerprint(d2t)
    weights.update(d2t=d2t, t2d=t2d)
    has_embeddings = "embed_tokens.weight" in weights
    if not has_embeddings:
        weights["embed_tokens.weight"] = model.embed_tokens.weight.data
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:  # missing, unexpected or misshapen tensors
        raise ConfigError(f"drafter.path: {path}: its weights do not fit its config.json "
                          f"({str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else err})") from None
    return model.to(getattr(torch, dtype)).eval().requires_grad_(False), has_embeddings
