"""The tokenizer files of a random chat checkpoint, per family: tokenizer.json with the family's special
tokens, and tokenizer_config.json with its chat template.

- Qwen3: byte-level BPE, ChatML (<|im_start|>role ... <|im_end|>), <think> as added text;
- Llama 3: byte-level BPE, header-style turns ending in <|eot_id|>, <|begin_of_text|> before each prompt;
- Llama 2: SentencePiece-style BPE (`▁`, byte fallback), [INST] turns, <s> before each prompt.
The templates are written for minfer in the style of each family's; they are not copies. With
`tools=True` Qwen3's and Llama 3's render tools too, each family its own way: Qwen3's lists them in a
system turn and has the model answer `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, results
coming back in `<tool_response>`; Llama 3's asks for a bare `{"name": ..., "parameters": ...}` object,
results coming back as an `ipython` turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, processors

from .tokenizer_training import train_sentencepiece_tokenizer, train_tokenizer

QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special, as in Qwen3: one id each, yet part of the reply's text (its reasoning).
QWEN3_ADDED = ["<think>", "</think>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# ChatML, as Qwen uses it: <|im_start|>role\ncontent<|im_end|>\n per message.
CHATML_TEMPLATE = """{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}
{{- raise_exception('unsupported role ' + message['role']) }}
{%- endif %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

# Llama 3's header style: the BOS token, then a header and an <|eot_id|>-terminated body per message.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

# Llama 2's [INST] style: each user turn `<s>[INST] ... [/INST]`, each reply ended by </s>; a system
# message goes first inside the first turn, between <<SYS>> markers. The reply starts after [/INST].
LLAMA2_TEMPLATE = """{%- if messages and messages[0]['role'] == 'system' %}
{%- set system, turns = messages[0]['content'] | trim, messages[1:] %}
{%- else %}
{%- set system, turns = none, messages %}
{%- endif %}
{%- for message in turns %}
{%- if message['role'] == 'user' %}
{{- bos_token + '[INST] ' }}
{%- if loop.first and system is not none %}
{{- '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}
{%- endif %}
{{- message['content'] | trim + ' [/INST]' }}
{%- elif message['role'] == 'assistant' %}
{{- ' ' + message['content'] | trim + ' ' + eos_token }}
{%- else %}
{{- raise_exception('unsupported role ' + message['role']) }}
{%- endif %}
{%- endfor %}"""


# A tool call's arguments as the template writes them: OpenAI's messages hold them as a JSON string.
_ARGUMENTS = "(call['function']['arguments'] if call['function']['arguments'] is string " \
             "else call['function']['arguments'] | tojson)"

# ChatML with tools: the tools in a system turn, calls in <tool_call> tags, results as <tool_response>.
CHATML_TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + tool | tojson }}
{%- endfor %}
{{- '\\n</tools>\\nTo call one: <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call>'
    '<|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] in ['system', 'user'] %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message['content'] }}
{%- for call in message['tool_calls'] or [] %}
{{- ('\\n' if message['content'] or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + call['function']['name']
    + '\", \"arguments\": ' + ARGUMENTS + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- raise_exception('unsupported role ' + message['role']) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}""".replace("ARGUMENTS", _ARGUMENTS)

# Llama 3 with tools: the tools in a system turn, a call as a bare JSON object ("; " between two),
# results as an ipython turn.
LLAMA3_TOOLS_TEMPLATE = """{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] | trim + '\\n\\n' }}
{%- endif %}
{{- 'Functions you may call, answering {\"name\": <name>, \"parameters\": <object>}:' }}
{%- for tool in tools %}
{{- '\\n' + tool | tojson }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first and tools %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- for call in message['tool_calls'] %}
{{- ('; ' if not loop.first else '') + '{\"name\": \"' + call['function']['name'] + '\", \"parameters\": '
    + ARGUMENTS + '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif message['role'] == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}""".replace("ARGUMENTS", _ARGUMENTS)


def write_tokenizer(out: Path, family: str, size: int, seed: int, max_length: int, tools: bool = False) -> None:
    """tokenizer.json (`size` ids) and tokenizer_config.json of a `family` checkpoint, written to out; with
    `tools`, a chat template that renders tools (Qwen3 and Llama 3)."""
    if family == "llama2":
        tokenizer = train_sentencepiece_tokenizer(size)
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                      "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
                      "add_bos_token": True, "add_eos_token": False, "chat_template": LLAMA2_TEMPLATE}
    elif family == "qwen3":
        tokenizer = train_tokenizer(size - len(QWEN3_ADDED), seed, QWEN3_SPECIALS)
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
        tok_config = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": max_length, "bos_token": None,
                      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                      "chat_template": CHATML_TOOLS_TEMPLATE if tools else CHATML_TEMPLATE}
    else:
        tokenizer = train_tokenizer(size, seed, LLAMA_SPECIALS)
        # Like Llama 3's, the tokenizer puts <|begin_of_text|> before every prompt.
        bos = ("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))
        tokenizer.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]),
        ])
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                      "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": None,
                      "chat_template": LLAMA3_TOOLS_TEMPLATE if tools else LLAMA3_TEMPLATE}
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
