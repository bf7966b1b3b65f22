"""Stage 14: from GPT-2 to a modern LLM (Qwen3, Llama): what changed, and what the engine did not notice.

Loads the GPT-2 of the other stages and writes a tiny random Qwen3 checkpoint
beside it, then checks each change the chapter describes: rotary positions
(attention sees only offsets), RMSNorm (no mean, no bias), grouped-query
attention (and the KV bytes it saves), the SwiGLU MLP, and the chat template.
Last, the same engine (LLM) runs both models, unchanged.

    python tutorials/14_modern_llm.py   # MINFER_MODEL=/path to choose the GPT-2 checkpoint
"""

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import model_path, section

from minfer import LLM, SamplingParams
from minfer.attention.kv_cache import KVCache
from minfer.checkpoints import write_random_checkpoint
from minfer.checkpoints.random_llama import make_llama_config
from minfer.models.llama import Llama, RMSNorm, apply_rope, rope_frequencies
from minfer.models.llama_config import LlamaConfig
from minfer.models.registry import load_model
from minfer.text.chat_template import ChatTemplate, render_chat
from minfer.text.tokenizer import Tokenizer

torch.manual_seed(0)
gpt2_path = model_path()
scratch = tempfile.TemporaryDirectory(prefix="minfer-qwen3-tiny-")  # removed when the script ends
qwen_path = Path(scratch.name)
write_random_checkpoint(qwen_path, "qwen3-tiny")
gpt2, qwen = load_model(gpt2_path), load_model(qwen_path)
assert isinstance(qwen, Llama) and qwen.config.architecture == "Qwen3ForCausalLM"
qc = qwen.config
print(
    f"Qwen3 (random, tiny): {qc.num_hidden_layers} layers, {qc.num_attention_heads} query heads and "
    f"{qc.num_key_value_heads} key/value heads of {qc.head_dim}, width {qc.hidden_size}, MLP {qc.intermediate_size}"
)

section("1. positions: a learned table vs rotary embeddings")
gpt2_positions = gpt2.wpe.weight.numel()
embeddings = [name for name, m in qwen.named_modules() if isinstance(m, torch.nn.Embedding)]
assert embeddings == ["embed_tokens"]  # tokens only: no position table
print(f"GPT-2 learns a ({gpt2.config.n_positions}, {gpt2.config.n_embd}) position table: {gpt2_positions:,} weights")
print("Qwen3 has none: it rotates each (channel i, channel i + D/2) pair of q and k by position x frequency")
inv_freq = rope_frequencies(qc)  # (D/2,)


def rotate(x, position):  # x (D,) at one position
    angles = torch.cat([position * inv_freq] * 2)[None]  # (1, D)
    return apply_rope(x[None, None], angles.cos(), angles.sin())[0, 0]


q, k = torch.randn(qc.head_dim), torch.randn(qc.head_dim)
scores = [float(rotate(q, 10 + shift) @ rotate(k, 5 + shift)) for shift in (0, 17, 300)]
print(f"q.k with k five tokens behind q, at three places in the text: {[f'{s:.5f}' for s in scores]}")
assert all(abs(s - scores[0]) < 1e-3 for s in scores)  # only the offset matters
assert abs(rotate(q, 10) @ rotate(k, 5) - rotate(q, 10) @ rotate(k, 9)) > 1e-3  # and the offset does matter

section("2. RMSNorm instead of LayerNorm")
x = torch.randn(4, qc.hidden_size)
norm = qwen.layers[0].input_layernorm
expected = x / x.pow(2).mean(-1, keepdim=True).add(qc.rms_norm_eps).sqrt() * norm.weight
torch.testing.assert_close(norm(x), expected)
layer_norm = torch.nn.LayerNorm(qc.hidden_size)
shifted = x + 3.0  # the same vector moved along the all-ones direction
torch.testing.assert_close(layer_norm(shifted), layer_norm(x), atol=1e-4, rtol=0)  # LayerNorm removes the mean
assert (RMSNorm.forward(norm, shifted) - norm(x)).abs().max() > 0.1  # RMSNorm does not: one op fewer
print("RMSNorm(x) = x / rms(x) * weight: no mean subtracted, no bias; LayerNorm ignores a shift, RMSNorm does not")

section("3. grouped-query attention, and the KV bytes it saves")
group = qc.num_attention_heads // qc.num_key_value_heads
attn = qwen.layers[0].self_attn
T = 6
h = torch.randn(1, T, qc.hidden_size)
qh = attn.q_proj(h).view(1, T, qc.num_attention_heads, qc.head_dim).transpose(1, 2)  # (1, nh, T, hd)
kh = attn.k_proj(h).view(1, T, qc.num_key_value_heads, qc.head_dim).transpose(1, 2)  # (1, n_kv, T, hd)
vh = attn.v_proj(h).view(1, T, qc.num_key_value_heads, qc.head_dim).transpose(1, 2)
shared = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
copied = F.scaled_dot_product_attention(
    qh, kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1), is_causal=True
)
torch.testing.assert_close(shared, copied)
print(f"each of the {qc.num_key_value_heads} key/value heads serves {group} query heads (enable_gqa: no copy)")


def kv_bytes_per_token(layers, kv_heads, head_dim, element=2):  # keys + values, every layer, bf16
    return 2 * layers * kv_heads * head_dim * element


shape = LlamaConfig(**{k: v for k, v in make_llama_config("qwen3-0.6b").items() if k in LlamaConfig.__annotations__})
real = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim)
without_gqa = kv_bytes_per_token(shape.num_layers, shape.num_heads, shape.head_dim)
gpt2_small = kv_bytes_per_token(12, 12, 64)
print(
    f"Qwen3-0.6B in bf16: {real / 1024:.0f} KiB of K/V per token with GQA, {without_gqa / 1024:.0f} KiB without; "
    f"GPT-2 small: {gpt2_small / 1024:.0f} KiB"
)
assert without_gqa == 2 * real and real == 112 * 1024
assert KVCache.bytes_per_block(qc, 16, torch.bfloat16) == 16 * kv_bytes_per_token(
    qc.num_layers, qc.num_key_value_heads, qc.head_dim
)  # the engine's cache stores only the key/value heads
print(f"a 32k-token context: {32768 * real / 2**30:.1f} GiB of KV cache in bf16 (with GQA)")

section("4. the SwiGLU MLP")
mlp = qwen.layers[0].mlp
torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
C, Fw = qc.hidden_size, qc.intermediate_size
assert sum(p.numel() for p in mlp.parameters()) == 3 * C * Fw  # three matrices, no biases
gc = gpt2.config
print(
    f"GPT-2: c_proj(gelu(c_fc(x))), 2 matrices of {gc.n_embd} x {gc.mlp_dim}; "
    f"Qwen3: down(silu(gate(x)) * up(x)), 3 matrices of {C} x {Fw}: the gate decides, per channel, how much passes"
)

section("5. chat templates")
tokenizer = Tokenizer.from_dir(qwen_path)
template = ChatTemplate.from_dir(qwen_path, tokenizer)
messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
text = template.render(messages)
print(text)
assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_end|>") == 2
im_end = tokenizer.token_to_id("<|im_end|>")
assert tokenizer.encode("<|im_end|>") == [im_end]  # one special token, never split into bytes
assert template.stop_token_ids == [im_end] and im_end in tokenizer.eos_token_ids  # a reply ends its turn here
print(f"GPT-2 has no template; minfer renders: {render_chat(messages)!r}")

section("6. the same engine runs both")
greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
prompt = tokenizer.encode(text)
for name, path in (("GPT-2", gpt2_path), ("Qwen3", qwen_path)):
    llm = LLM(str(path), num_kv_blocks=16)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0]
    cache = llm.scheduler.kv_cache.k
    print(f"{name}: {out.token_ids[:8]}...; KV cache (layers, slots, kv heads, head dim) = {tuple(cache.shape)}")
    if name == "Qwen3":
        assert cache.shape[2] == qc.num_key_value_heads
        ids = torch.tensor([prompt])
        with torch.inference_mode():  # the engine's paged, batched forward against the plain one
            for _ in range(12):
                ids = torch.cat([ids, qwen(ids)[:, -1:].argmax(-1)], dim=1)
        assert out.token_ids == ids[0, len(prompt) :].tolist()
print("the engine asked neither model what it is: only config facts (layers, KV heads, head_dim, context)")
