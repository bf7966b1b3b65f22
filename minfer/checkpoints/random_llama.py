"""Random Qwen3 and Llama checkpoints: the files a chat model ships, with random weights.

Besides config.json and model.safetensors (transformers' tensor names), a chat model
ships a tokenizer with special tokens (<|im_start|>, <|im_end|>, ...), a chat template
in tokenizer_config.json, and generation_config.json listing the ids that end a reply.
The templates here are written for minfer in the style of Qwen3's (ChatML) and
Llama 3's; they are not copies of either. With `tools=True` the checkpoint's template
renders tools too, each family its own way: Qwen3's lists them in a system turn and
has the model answer `<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
results coming back in `<tool_response>`; Llama 3's asks for a bare
`{"name": ..., "parameters": ...}` object, results coming back as an `ipython` turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, processors

from .files import save_safetensors
from .tokenizer_training import train_tokenizer

LLAMA_CONFIGS = {
    # Qwen3: explicit head_dim (here twice hidden / heads, as in Qwen3-0.6B), q/k norms, tied embeddings.
    "qwen3-tiny": dict(
        family="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
    ),
    # Llama: head_dim = hidden / heads, an LM head of its own.
    "llama-tiny": dict(
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    # The shape of Qwen/Qwen3-0.6B (0.6B parameters, stored in bf16 like the real one); its tokenizer
    # is smaller than the 151,936-row embedding (the real one's is too, if less so): 32k keeps it quick.
    "qwen3-0.6b": dict(
        family="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tokenizer_size=32000,
        torch_dtype="bfloat16",
    ),
}

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


def make_llama_config(preset: str, **overrides) -> dict:
    """A config.json dict in the format transformers writes for Qwen3ForCausalLM / LlamaForCausalLM."""
    shape = {**LLAMA_CONFIGS[preset], **overrides}
    family = shape.pop("family")
    shape.pop("tokenizer_size", None)
    tokenizer_size = LLAMA_CONFIGS[preset].get("tokenizer_size", shape["vocab_size"])
    specials = QWEN3_SPECIALS if family == "qwen3" else LLAMA_SPECIALS
    added = QWEN3_ADDED if family == "qwen3" else []
    first_special = tokenizer_size - len(added) - len(specials)  # after the learned tokens
    ids = {t: first_special + i for i, t in enumerate(specials)}
    common = dict(
        hidden_act="silu",
        rms_norm_eps=1e-6 if family == "qwen3" else 1e-5,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        torch_dtype=shape.pop("torch_dtype", "float32"),
        use_cache=True,
    )
    if family == "qwen3":
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **common,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": shape["num_hidden_layers"],
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            **shape,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common,
        "mlp_bias": False,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]],
        **shape,
    }


def random_llama_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under transformers' names (nn.Linear weights are [out, in])."""
    g = torch.Generator().manual_seed(seed)
    C, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H, KV = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or C // H

    def normal(*shape, scale=0.02):
        return torch.randn(*shape, generator=g) * scale

    def linear(fan_in, fan_out):  # O(1) outputs, so each block really changes the residual stream
        return normal(fan_out, fan_in, scale=fan_in**-0.5)

    def norm_weight(n):  # near 1, but not exactly, so a missing norm shows
        return 1.0 + normal(n, scale=0.1)

    sd = {"model.embed_tokens.weight": normal(V, C, scale=C**-0.5), "model.norm.weight": norm_weight(C)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_weight(C)
        sd[p + "self_attn.q_proj.weight"] = linear(C, H * D)
        sd[p + "self_attn.k_proj.weight"] = linear(C, KV * D)
        sd[p + "self_attn.v_proj.weight"] = linear(C, KV * D)
        sd[p + "self_attn.o_proj.weight"] = linear(H * D, C)
        if config["model_type"] == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = norm_weight(D)
            sd[p + "self_attn.k_norm.weight"] = norm_weight(D)
        sd[p + "post_attention_layernorm.weight"] = norm_weight(C)
        sd[p + "mlp.gate_proj.weight"] = linear(C, F)
        sd[p + "mlp.up_proj.weight"] = linear(C, F)
        sd[p + "mlp.down_proj.weight"] = linear(F, C)
    if not config["tie_word_embeddings"]:
        sd["lm_head.weight"] = linear(C, V)
    return sd


def write_random_llama(out: Path, preset: str, seed: int = 0, tools: bool = False, **overrides) -> Path:
    """config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat template (one that
    renders tools, with `tools`), generation_config.json."""
    config = make_llama_config(preset, **overrides)
    qwen = config["model_type"] == "qwen3"
    dtype = torch.bfloat16 if config["torch_dtype"] == "bfloat16" else torch.float32
    tensors = {k: v.to(dtype) for k, v in random_llama_state_dict(config, seed).items()}
    save_safetensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = QWEN3_SPECIALS if qwen else LLAMA_SPECIALS
    tokenizer_size = LLAMA_CONFIGS[preset].get("tokenizer_size", config["vocab_size"])
    added = QWEN3_ADDED if qwen else []
    tokenizer = train_tokenizer(tokenizer_size - len(added), seed, specials)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if not qwen:  # like Llama 3's, the tokenizer puts <|begin_of_text|> before every prompt
        bos = ("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
                ),
            ]
        )
    tokenizer.save(str(out / "tokenizer.json"))
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    if qwen:  # a Qwen3 reply ends with <|im_end|>; plain text with <|endoftext|>
        eos = [config["eos_token_id"], config["bos_token_id"]]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tok_config = {
        "tokenizer_class": "Qwen2Tokenizer" if qwen else "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "bos_token": None if qwen else "<|begin_of_text|>",
        "eos_token": "<|im_end|>" if qwen else "<|eot_id|>",
        "pad_token": "<|endoftext|>" if qwen else None,
        "chat_template": (CHATML_TOOLS_TEMPLATE if qwen else LLAMA3_TOOLS_TEMPLATE) if tools
        else (CHATML_TEMPLATE if qwen else LLAMA3_TEMPLATE),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out
