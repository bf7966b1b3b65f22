"""Exercise 03: one attention layer with a KV cache that takes a chunk of new tokens after a past.

Write `attention_with_cache`. Stage 03's loop feeds the model the prompt first (no past) and then one
token at a time; the stage also prefills the prompt in chunks, each one after the cached keys and
values of the chunks before it. Then run

    python tutorials/03_kv_cache_generation.py --exercise

and the stage's loops run on your function: the tokens must equal those of the loop without a
cache, and the prompt in chunks must leave the same cache and logits as the prompt at once. The
script's own attention_with_cache is a worked answer; minfer's engine does the same for a chunk of a
prompt in TorchBackend.prefill_chunk (the mask) and TorchBackend.prefill_attention, in
minfer/attention/torch_sdpa.py.

What you get: `attn`, one layer's CausalSelfAttention (minfer/models/gpt2.py), whose attn.c_attn makes
q, k and v (each C wide) from x, attn.c_proj mixes the heads' outputs, attn.n_head, attn.head_dim and
attn.scale are what their names say.
"""

from __future__ import annotations


def attention_with_cache(attn, x, past):
    """One attention layer over T new positions x (1, T, C), after `past`: None, or the cached keys and
    values (K, V) of the P positions before, each (1, n_head, P, head_dim). Returns the layer's output
    (1, T, C) and the cache extended by this chunk's keys and values, each (1, n_head, P + T, head_dim).

    New position i (at P + i) may attend to every cached position and to new positions up to itself:
    a causal mask over P + T keys, shifted right by P. With no past that is the plain causal mask;
    for one new token it lets it see everything.
    """
    raise NotImplementedError
