"""The tokenizer files of a random chat checkpoint, per family: tokenizer.json with the family's special
tokens, and tokenizer_config.json with its chat template.

- Qwen3: byte-level BPE, ChatML (<|im_start|>role ... <|im_end|>), <think> as added text;
- Llama 3: byte-level BPE, header-style turns ending in <|eot_id|>, <|begin_of_text|> before each prompt;
- Llama 2: SentencePiece-style BPE (`▁`, byte fallback), [INST] turns, <s> before each prompt.
The templates are written for minfer in the style of each family's; they are not copies.
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


def write_tokenizer(out: Path, family: str, size: int, seed: int, max_length: int) -> None:
    """tokenizer.json (`size` ids) and tokenizer_config.json of a `family` checkpoint, written to out."""
    if family == "llama2":
        tokenizer = train_sentencepiece_tokenizer(size)
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                      "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
                      "add_bos_token": True, "add_eos_token": False, "chat_template": LLAMA2_TEMPLATE}
    elif family == "qwen3":
        tokenizer = train_tokenizer(size - len(QWEN3_ADDED), seed, QWEN3_SPECIALS)
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
        tok_config = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": max_length, "bos_token": None,
                      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}
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
                      "chat_template": LLAMA3_TEMPLATE}
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
