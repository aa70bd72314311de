"""Chat templates of the shapes real checkpoints ship (Qwen3's tools and thinking section, a plain
one without either), and a tiny random Llama that carries one: the models of the tool, reasoning and
OpenAI tests (text-only, so a call costs milliseconds).

QWEN3_TEMPLATE follows Qwen3's own template: tools listed in the system turn as `tool | tojson` lines,
an assistant's calls written `<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>`, tool results
as `<tool_response>` blocks in a user turn, and `<think>` sections. `thinking="open"` ends the
generation prompt with `<think>\\n` as Qwen3 Thinking checkpoints do; `thinking=None` leaves the
section out altogether.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from foveal.testing import tiny

_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
_TURNS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
)
_GENERATION = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
_THINK_NOTE = "{#- assistant turns may hold <think> sections #}"
QWEN3_TEMPLATE = _TOOLS + _TURNS + _THINK_NOTE + _GENERATION
QWEN3_OPEN_TEMPLATE = _TOOLS + _TURNS + _GENERATION.replace("assistant\\n", "assistant\\n<think>\\n")
NO_THINK_TEMPLATE = _TOOLS + _TURNS + _GENERATION
# A template without tools or thinking (foveal's JSON tool format applies).
PLAIN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}" + _GENERATION
)


def build_llama_with_template(folder: Path, template: str) -> Path:
    """The tiny random Llama of foveal.testing.tiny with `template` as its tokenizer's chat template, and
    2048 positions (tool definitions make long prompts in its 300-token vocabulary)."""
    tiny.build_llama(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder
