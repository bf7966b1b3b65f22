"""Decode attention through each backend, side by side: time per layer and the context bytes it reads.

    python scripts/attention_ab.py --device cuda --seqs 256 --context 1024      (Qwen3-0.6B's heads)
    python scripts/attention_ab.py --seqs 16 --context 512 --backends torch,cpu_tiled,compiled,flex
    python scripts/attention_ab.py --device cuda --seqs 256 --context 1024 --backends torch,flex,flex-static

One layer's paged cache, every sequence's blocks shuffled through it, one query per sequence: what a
decode step asks of attention in each of its layers. Bytes are the context's keys and values, read
once; over the time that is the bandwidth the read reached (its floor: the device's own, which
`bench.py --roofline` measures). Each backend's result is checked against the plain one first.

`flex-static` is flex compiled for this one shape, as a CPU compiles it, where the engine on a GPU compiles
it with dynamic shapes: torch picks its decoding kernel (the keys split across the GPU, a kernel per group
of query heads) only for a batch it knows at compile time.
"""

from __future__ import annotations

import argparse

import torch

from minfer.attention.kv_cache import cdiv
from minfer.compiled.attention import BlockedKVCache, slots_to_blocks
from minfer.attention.backend import StepLayout
from minfer.assembly.selector import ATTENTION_BACKENDS
from minfer.bench.roofline import best_time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="tokens of context per sequence")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backends", default="torch,flex",
                   help="names in attention/selector.py, or flex-static; the first the reference")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    S, L, B = args.seqs, args.context, args.block_size
    config = argparse.Namespace(num_layers=1, num_kv_heads=args.kv_heads, head_dim=args.head_dim, max_positions=L)
    num_blocks = S * cdiv(L, B)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(num_blocks, generator=gen).view(S, -1).tolist()  # each sequence's blocks, scattered
    layout = StepLayout(
        slot_mapping=torch.tensor([t[(L - 1) // B] * B + (L - 1) % B for t in order], device=device),
        query_starts=list(range(S)),
        query_lens=[1] * S,
        context_lens=[L] * S,
        block_tables=order,
        block_size=B,
        null_block=num_blocks,
    )
    q = torch.randn(S, args.heads, args.head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(S, args.kv_heads, args.head_dim, generator=gen).to(device, dtype) for _ in range(2))
    rows = torch.randn(num_blocks * B, 2, args.kv_heads, args.head_dim, generator=gen).to(device, dtype)
    context_bytes = S * L * 2 * args.kv_heads * args.head_dim * rows.element_size()
    print(f"{S} sequences x {L} tokens, {args.heads}/{args.kv_heads} heads of {args.head_dim}, {args.dtype}, {device}:")
    print(f"  context {context_bytes / 2**20:.1f} MiB per layer")
    reference = None
    for name in args.backends.split(","):
        backend = ATTENTION_BACKENDS["flex" if name == "flex-static" else name][0](device, dtype)
        if name == "flex-static":
            backend.compiles_per_shape = False  # FlexBackend._attend: torch.compile per shape, torch's tiles
        if why := backend.warm_up(args.heads, args.kv_heads, args.head_dim, B):
            print(f"  {name:<12} off: {why}")
            continue
        cache = backend.new_cache(config, num_blocks, B, device, dtype)
        cache.kv.zero_()
        if isinstance(cache, BlockedKVCache):  # a block a row, keys transposed
            cache.kv[0, :num_blocks] = slots_to_blocks(rows, B)
        else:
            cache.kv[0, : num_blocks * B] = rows
        meta = backend.build_metadata(layout)

        def step(backend=backend, layer=cache.kv[0], meta=meta):
            return backend.forward(q, k, v, layer, meta, args.head_dim**-0.5)

        try:
            with torch.inference_mode():
                out = step()
                reference = out.float() if reference is None else reference
                error = (out.float() - reference).abs().max().item()
                seconds = best_time(step, device, args.repeats)
        except Exception as e:  # a compile error at this shape (a CPU's flex template has some): say so, go on
            print(f"  {name:<12} failed: {type(e).__name__}: {str(e).strip().splitlines()[0]}")
            continue
        gbs = context_bytes / seconds / 1e9
        print(f"  {name:<12} {seconds * 1e3:8.3f} ms  {gbs:7.1f} GB/s  (max error against the first {error:.1e})")


if __name__ == "__main__":
    main()
