"""Multi-turn conversations in the target's own chat template, and which of their tokens the drafter learns.

Records: ShareGPT style ``{"conversations": [{"from": "human" | "gpt" | ..., "value": ...}]}`` or OpenAI style
``{"messages": [{"role": "user" | "assistant" | "system", "content": ...}]}``; ``normalize`` turns either into
``[{"role": "system" | "user" | "assistant", "content": str}]``.

The assistant mask (``ChatTemplate.encode``) is computed from the FINAL rendering of the whole conversation, the text
the model sees in training, so templates that rewrite earlier turns (Qwen3 drops the <think> block of every
assistant turn before the last user turn) get the mask of what they actually render. For assistant turn k:
  1. where its content lies in the rendering: the characters that change when only turn k's content is replaced by
     a probe string (two probes with different first and last characters, so neither can share an edge with the
     real content by chance). This follows whatever the template does to the content (trim, strip <think>...);
  2. the turn starts at the end of its generation prompt (the conversation before turn k rendered with
     ``add_generation_prompt``: "<|im_start|>assistant\\n", "[/INST]", ...), i.e. with what the target generates
     after it (a Qwen3 "<think>" opening included); when that prompt is not a prefix of the final rendering
     (Qwen3 with thinking stripped: its prompt ends with an empty think block that earlier turns do not render),
     the turn starts where it first differs from the rendering, never before the previous message's end and never
     after the content;
  3. the turn ends with the first end-of-sequence token (the target's EOS ids: <|im_end|>, <|eot_id|>,
     <end_of_turn>, <|end|>, </s>) after its content and before the next message's content: the token the target
     stops on. Template text after it (a newline, the next header) is not generated and not learned.
A token is learned when its first character lies in [start, end of step 3). ``apply_chat_template``'s own
``return_assistant_tokens_mask`` needs ``{% generation %}`` markers that most shipped templates lack; this works
with any template that renders assistant turns.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

import jinja2
from transformers import PreTrainedTokenizerBase

from drafter_train.errors import ConfigError

# Source role names -> the roles chat templates know.
ROLES = {"system": "system", "developer": "system", "human": "user", "user": "user", "gpt": "assistant",
         "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "assistant": "assistant",
         "model": "assistant"}
CONVERSATION_COLUMNS = ("messages", "conversations")
THINKING = ("keep", "strip")
_PROBES = ("\x01", "\x02")  # first/last characters differ: one of them differs from the real content's edge
_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.S)


class BadRecord(ValueError):
    """A conversation that cannot be used; the message is one line. Datagen counts and skips it."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # the key it is counted under in datagen.json's skipped counts


def normalize(record: dict, column: Optional[str] = None) -> list[dict]:
    """A source record -> its messages with known roles and text content, trailing non-assistant turns dropped
    (nothing to learn after the last answer). Raises BadRecord naming what is wrong."""
    turns = _turns(record, column)
    messages = [_message(turn, i) for i, turn in enumerate(turns)]
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        raise BadRecord("no_assistant", "no assistant turn")
    first = next(m for m in messages if m["role"] != "system")
    if first["role"] != "user":
        raise BadRecord("not_user_first", "the conversation opens with an assistant turn, not a user turn")
    return messages


def _turns(record: dict, column: Optional[str]) -> list:
    names = (column,) if column else CONVERSATION_COLUMNS
    turns = next((record[name] for name in names if isinstance(record, dict) and record.get(name) is not None), None)
    if not isinstance(turns, list) or not turns:
        raise BadRecord("no_messages", f"no {' or '.join(repr(n) for n in names)} list of turns")
    return turns


def _message(turn: object, index: int) -> dict:
    if not isinstance(turn, dict):
        raise BadRecord("bad_turn", f"turn {index} is a {type(turn).__name__}, not a mapping")
    role = turn.get("role") if turn.get("role") is not None else turn.get("from")  # columnar rows: None = absent
    if role not in ROLES:
        raise BadRecord("unknown_role", f"turn {index} has the unknown role {role!r} (known: {', '.join(ROLES)})")
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(content, str):
        raise BadRecord("bad_turn", f"turn {index} has no text content")
    return {"role": ROLES[role], "content": content}


def strip_thinking(messages: Iterable[dict]) -> list[dict]:
    """The messages with every <think>...</think> block removed from assistant turns (datagen.thinking=strip)."""
    return [dict(m, content=_THINK_BLOCK.sub("", m["content"])) if m["role"] == "assistant" else dict(m)
            for m in messages]


class ChatTemplate:
    """The target tokenizer's chat template, rendering conversations and their assistant masks (module doc).

    ``thinking`` is passed to the template as ``enable_thinking`` (keep: true, strip: false; templates without the
    variable ignore it), so generation prompts and renderings are the ones a server with that setting uses."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int], thinking: str = "keep"):
        self.tokenizer, self.eos = tokenizer, set(eos_token_ids)
        self.thinking = thinking
        self.kwargs = {"enable_thinking": thinking == "keep"}
        check_template(self)

    def render(self, messages: Sequence[dict], generation: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation,
                                                      **self.kwargs)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise BadRecord("template_error", f"the chat template refuses it: {first}") from None

    def ids(self, text: str) -> list[int]:
        # Templates write their own BOS (if any); letting the tokenizer add one too would double it.
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The conversation so far plus the generation prompt: what the target continues for the next turn."""
        return self.ids(self.render(messages, generation=True))

    def encode(self, messages: Sequence[dict], cut: Sequence[int] = ()) -> tuple[list[int], list[int]]:
        """(token ids of the whole rendered conversation, 1 where the token belongs to an assistant turn). Turns at
        the message indices `cut` were cut at max_new_tokens: the end token the template writes after them is not
        learned (the target did not stop there)."""
        text = self.render(messages)
        spans = content_spans(self, messages, text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, starts = list(enc.input_ids), [start for start, _ in enc.offset_mapping]
        mask = [0] * len(ids)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if spans[k] is None:
                raise BadRecord("template_error", f"the chat template does not render assistant turn {k}")
            begin = self._turn_start(messages, k, text, spans)
            limit = next((s[0] for s in spans[k + 1:] if s is not None), len(text))
            _mark(mask, ids, starts, (begin, spans[k][1], limit), set() if k in cut else self.eos)
        return ids, mask

    def _turn_start(self, messages: Sequence[dict], k: int, text: str, spans: list) -> int:
        """Step 2 of the module doc: the end of turn k's generation prompt as far as the final rendering agrees."""
        agreed = common_prefix(text, self.render(messages[:k], generation=True))
        previous_end = max((s[1] for s in spans[:k] if s is not None), default=0)
        content_start = spans[k][0]
        return agreed if previous_end <= agreed <= content_start else content_start


def content_spans(chat: ChatTemplate, messages: Sequence[dict], text: str) -> list[Optional[tuple[int, int]]]:
    """Per message, [start, end) of its content in ``text`` (the rendering of ``messages``); None when the template
    does not render it (step 1 of the module doc)."""
    spans: list[Optional[tuple[int, int]]] = []
    for k, message in enumerate(messages):
        starts, ends = [], []
        for probe in _PROBES:
            other = chat.render([*messages[:k], dict(message, content=probe), *messages[k + 1:]])
            starts.append(common_prefix(text, other))
            ends.append(len(text) - common_suffix(text, other))
        start, end = min(starts), max(ends)
        spans.append(None if start == len(text) and end == 0 else (start, max(start, end)))
    return spans


def _mark(mask: list[int], ids: list[int], starts: list[int], bounds: tuple[int, int, int], eos: set[int]) -> None:
    """Set the mask of one assistant turn: tokens starting in [begin, content_end), then on to the first EOS token
    that starts before `limit` (the next message's content); without one the turn ends with its content."""
    begin, content_end, limit = bounds
    inside = [t for t, s in enumerate(starts) if begin <= s < content_end]
    after = [t for t, s in enumerate(starts) if content_end <= s < limit and t > (inside[-1] if inside else -1)]
    stop = next((t for t in after if ids[t] in eos), None)
    if stop is not None:
        first = inside[0] if inside else next(t for t in after if starts[t] >= begin)
        inside = list(range(first, stop + 1))
    for t in inside:
        mask[t] = 1


def check_template(chat: ChatTemplate) -> None:
    """Refuse, in one line naming target.chat_template, a template the masks cannot be computed from: none at all,
    one that does not render assistant turns, or one with no generation marker (add_generation_prompt adds nothing
    although assistant turns carry a header: the target would continue prompts that lack it)."""
    tokenizer = chat.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("target.chat_template: datagen.multi_turn needs the target's chat template, and its "
                          "tokenizer has none")
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError("target.chat_template: datagen.multi_turn needs a fast tokenizer (token offsets)")
    user = [{"role": "user", "content": "Hello"}]
    probe = [*user, {"role": "assistant", "content": "World"}]
    try:
        text = chat.render(probe)
        span = content_spans(chat, probe, text)[1]
        plain, prompt = chat.render(user), chat.render(user, generation=True)
    except BadRecord as err:
        raise ConfigError(f"target.chat_template: it fails on a two-turn conversation: {err}") from None
    if span is None:
        raise ConfigError("target.chat_template: the template does not render assistant turns")
    header = text[common_prefix(plain, text):span[0]]
    if prompt == plain and header.strip():
        raise ConfigError(f"target.chat_template: the template has no generation marker: add_generation_prompt "
                          f"adds nothing, though assistant turns start with {header.strip()!r}")


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over slice comparisons, which run in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if a[:mid] == b[:mid] else (low, mid - 1)
    return low


def common_suffix(a: str, b: str) -> int:
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if a[len(a) - mid:] == b[len(b) - mid:] else (low, mid - 1)
    return low
