"""Exercise 08: paged attention over block tables, the plain way (gather, then attend).

Write `forward`, what every attention layer of the engine runs once per step: store this step's
keys and values in their cache slots, then let every row attend over its own sequence's context,
read through the slots the metadata lists. Then run

    python tutorials/08_paged_attention.py --exercise

and the stage's hand-built steps, and then the whole engine, run on your function: each output must
equal dense attention, and the engine's greedy tokens those of the model without a cache. minfer's own
is TorchBackend.forward (with decode_attention and prefill_attention) in minfer/attention/torch_sdpa.py.

What you get (shapes: N rows this step, H query heads, Hkv key/value heads, D head size):
- q (N, H, D), k and v (N, Hkv, D): the step's rows, every sequence's side by side;
- kv_cache (num_slots, 2, Hkv, D): one layer's cache, kv_cache[s, 0] a slot's key, kv_cache[s, 1] its value;
- meta (a GatheredMetadata from minfer.attention.torch_sdpa):
  - meta.slot_mapping (N,): the slot each row's key and value go to;
  - meta.decode_groups: DecodeGroups, rows that are one new token of a sequence already cached:
    .rows (S,) their rows, .slots (S, L) each one's whole context as slots, padded to the longest
    (the padding points at the zeroed null block), .mask (S, 1, 1, L) False on padding, or None;
  - meta.prefills: PrefillChunks, several rows of one sequence: rows .start to .end; .context_slots
    (L,) the slots of its whole context, or None for a fresh prompt (its own new keys are the context,
    causal); .mask (T, L), True where query i may see position j, when context_slots is set;
- scale: the softmax scale (1 / sqrt(D) for GPT-2).
Use torch.nn.functional.scaled_dot_product_attention; it takes (batch, heads, queries, D) tensors, a
boolean attn_mask, is_causal, scale, and enable_gqa=True when H != Hkv.
"""

from __future__ import annotations


def forward(self, q, k, v, kv_cache, meta, scale: float):
    """Write k and v into kv_cache at meta.slot_mapping, then attend; returns (N, H, D).

    1. Store first (kv_cache.index_copy_, or indexing): the step's queries attend to its own keys too.
    2. Each decode group: gather kv_cache[group.slots] (S, L, 2, Hkv, D), make keys and values
       (S, Hkv, L, D), attend with one query per sequence (S, H, 1, D) under group.mask, and put the
       results in the group's rows.
    3. Each prefill chunk: its queries (H, T, D); keys and values either its own new ones (context_slots
       None: attend causally) or its context gathered through context_slots (attend under chunk.mask).
    `self` is the backend (a TorchBackend); you need nothing from it.
    """
    raise NotImplementedError
