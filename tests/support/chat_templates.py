"""Reasoning chat templates for the templating tests, on the tiny test tokenizer.

QWEN3_STYLE follows Qwen3's published template (its tool instructions shortened): reasoning
kept only on assistant turns after the last user query (`<think>\\n...\\n</think>\\n\\n`),
inline `</think>` split out of content when
`reasoning_content` is absent, tool calls as `<tool_call>` JSON, tool results as user turns in
`<tool_response>`, `enable_thinking: false` adding an empty think block to the generation
prompt. The Kimi-style template is the replica's own (eagleflow.embedded.tiny_kimi).
`kimi_published_rule()` keeps reasoning as Kimi-K2-Thinking's published template does (as
read in tinker-cookbook's renderer and the template's `hist_msgs` / `suffix_msgs` split): only
on assistant turns after the last assistant turn without tool calls, so a finished answer
never shows its reasoning.
"""

from __future__ import annotations

QWEN3_STYLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and"
    " not(message.content.startswith('<tool_response>') and"
    " message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}"
    "{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
QWEN3_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

# Reasoning ignored: a template that renders role and content only.
PLAIN = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\\n{%- endif %}"
)


def with_template(tokenizer, template: str, tokens=()):
    """A copy of the tiny test tokenizer with `template` and `tokens` as special tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
    )
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    tok.chat_template = template
    return tok


def kimi_tokens():
    from eagleflow.embedded import tiny_kimi

    return [n for n in tiny_kimi.SPECIAL_OFFSETS if n.startswith("<")]


def kimi_style(tokenizer):
    from eagleflow.embedded import tiny_kimi

    return with_template(tokenizer, tiny_kimi.CHAT_TEMPLATE, kimi_tokens())


def qwen3_style(tokenizer):
    return with_template(tokenizer, QWEN3_STYLE, QWEN3_TOKENS)


def kimi_published_rule():
    """The replica's template with the published template's history rule (module docstring)."""
    from eagleflow.embedded import tiny_kimi

    rule = (
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}"
        "{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
    )
    old = (
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
    )
    assert old in tiny_kimi.CHAT_TEMPLATE
    return tiny_kimi.CHAT_TEMPLATE.replace(old, rule)
