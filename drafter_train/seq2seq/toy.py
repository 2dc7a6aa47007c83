"""A rule-based toy translation and a tiny Marian target trained on it in-process (no pretrained weights offline).

Source grammar (SVO, adjectives before the noun):   S = CLAUSE [CONJ CLAUSE];   CLAUSE = NP VERB NP [ADV];
                                                    NP = DET ADJ{0,2} NOUN
Translation, clause by clause (SOV, adjectives after the noun in reverse order; a dictionary maps every word, some
nouns to two target words):                          CLAUSE' = NP' NP' VERB' [ADV'];  NP' = DET' NOUN' ADJ'{reversed}

    "de1 da3 dn7 dv2 de0 dn4 db1"  ->  "te. tn. ta. te. tn. tv. tb."   (each index through the dictionary)

Everything is deterministic given a seed: `make_pairs` writes the train/dev/test splits as jsonl (source, target),
`toy_tokenizer` is a word-level tokenizer over both vocabularies, `train_toy_target` fits the target to the
reference translations (the drafters are then trained on what the target itself outputs, data.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import MarianConfig, MarianMTModel, PreTrainedModel, PreTrainedTokenizerFast

from drafter_train.seq2seq.training import optimizer_step

# Source word classes (prefix, count); the target word for class c, index i is t<c>[perm(i)].
# determiners, adjectives, nouns, verbs, adverbs, conjunctions
CLASSES = {"e": 4, "a": 10, "n": 24, "v": 10, "b": 6, "c": 3}
SPECIALS = ["<pad>", "</s>", "<unk>"]  # Marian's: pad 0 (also the decoder start), EOS 1
SPLITS = {"train": 4000, "dev": 64, "test": 64}


def make_dictionary(seed: int) -> dict[str, list[str]]:
    rng, words = random.Random(seed), {}
    for cls, count in CLASSES.items():
        perm = list(range(count))
        rng.shuffle(perm)
        for i in range(count):
            words[f"d{cls}{i}"] = [f"t{cls}{perm[i]}"] + (["tx"] if cls == "n" and i % 5 == 0 else [])
    return words


def _clause(words: list[str], dictionary: dict[str, list[str]]) -> list[str]:
    nps, current = [], []
    for word in words:  # cut into noun phrases; a verb or adverb stands alone
        current.append(word)
        if word[1] in "nvb":
            nps.append(current)
            current = []
    subject, verb, obj, *adverb = nps
    out = []
    for det, *adjs, noun in (subject, obj):
        out += dictionary[det] + dictionary[noun] + [w for a in reversed(adjs) for w in dictionary[a]]
    return out + dictionary[verb[0]] + [w for a in adverb for w in dictionary[a[0]]]


def translate(source: str, dictionary: dict[str, list[str]]) -> str:
    """The reference translation of a source sentence (module doc)."""
    out, clause = [], []
    for word in source.split() + ["dc"]:  # a conjunction (and the end) closes a clause
        if word.startswith("dc"):
            out += _clause(clause, dictionary) + (dictionary[word] if word != "dc" else [])
            clause = []
        else:
            clause.append(word)
    return " ".join(out)


def random_sentence(rng: random.Random) -> str:
    def pick(cls: str) -> str:
        return f"d{cls}{rng.randrange(CLASSES[cls])}"

    def noun_phrase() -> list[str]:
        return [pick("e")] + [pick("a") for _ in range(rng.choice([0, 0, 1, 2]))] + [pick("n")]

    def clause() -> list[str]:
        return noun_phrase() + [pick("v")] + noun_phrase() + ([pick("b")] if rng.random() < 0.5 else [])

    words = clause() + ([pick("c")] + clause() if rng.random() < 0.6 else [])
    return " ".join(words)


def make_pairs(out_dir: str | Path, seed: int = 0, sizes: dict = SPLITS) -> dict[str, Path]:
    """Write <out_dir>/<split>.jsonl with {"source", "target"} rows; returns split -> path."""
    rng, dictionary, paths = random.Random(seed), make_dictionary(seed), {}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for split, size in sizes.items():
        sources = [random_sentence(rng) for _ in range(size)]
        paths[split] = Path(out_dir) / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps({"source": s, "target": translate(s, dictionary)}) + "\n"
                                        for s in sources))
    return paths


def toy_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level over both vocabularies; appends </s> to every text, as Marian's tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = [f"{side}{cls}{i}" for side in "dt" for cls, n in CLASSES.items() for i in range(n)] + ["tx"]
    vocab = {token: i for i, token in enumerate(SPECIALS + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def toy_target(vocab_size: int, d_model: int = 96, encoder_layers: int = 2, decoder_layers: int = 4,
               seed: int = 0) -> MarianMTModel:
    """A fresh Marian model sized for the toy task (no dropout: the toy has no noise to regularise against)."""
    torch.manual_seed(seed)
    config = MarianConfig(vocab_size=vocab_size, d_model=d_model, encoder_layers=encoder_layers,
                          decoder_layers=decoder_layers, encoder_attention_heads=4, decoder_attention_heads=4,
                          encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model, max_position_embeddings=64,
                          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=None,
                          dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True)
    model = MarianMTModel(config)
    model.generation_config.update(decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, bad_words_ids=None,
                                   forced_eos_token_id=None, num_beams=1, max_length=64)
    return model


def train_toy_target(model: PreTrainedModel, tokenizer, pairs_path: str | Path, steps: int, batch_size: int = 48,
                     lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Cross-entropy on the reference translations; returns each step's loss. The model is left in eval mode."""
    rows = [json.loads(line) for line in Path(pairs_path).read_text().splitlines()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng, losses = random.Random(seed), []
    model.train()
    for _ in range(steps):
        batch = rng.sample(rows, batch_size)
        enc = tokenizer([r["source"] for r in batch], padding=True, return_tensors="pt")
        labels = tokenizer([r["target"] for r in batch], padding=True, return_tensors="pt").input_ids
        labels = labels.masked_fill(labels == tokenizer.pad_token_id, -100)
        losses.append(optimizer_step(model(**enc, labels=labels).loss, optimizer, schedule))
    model.eval()
    return losses
