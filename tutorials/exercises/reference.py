"""minfer's own code under the exercise stubs' names: what the tests plug in, through the same path as a
learner's file, so that every stage passes with it and the plug itself is tested."""

from __future__ import annotations

import torch

from minfer.attention.backend import StepLayout
from minfer.attention.torch_sdpa import TorchBackend
from minfer.engine.block_allocator import BlockAllocator
from minfer.engine.continuous_batcher import ContinuousBatcher
from minfer.server.manager import SchedulerManager

_CPU_BACKEND = TorchBackend("cpu", torch.float32)


def attention_with_cache(attn, x: torch.Tensor, past: tuple | None):
    """Exercise 03 through the engine's own code for a prompt chunk after a past: TorchBackend.prefill_chunk
    builds the shifted causal mask from a one-block layout of the chunk, prefill_attention attends."""
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)  # 3 x (1, T, C)
    q, k, v = (t.view(B, T, attn.n_head, attn.head_dim).transpose(1, 2) for t in (q, k, v))  # (1, nh, T, hd)
    if past is not None:
        k = torch.cat([past[0], k], dim=2)  # (1, nh, P + T, hd)
        v = torch.cat([past[1], v], dim=2)
    L = k.shape[2]
    layout = StepLayout(  # one sequence, its whole context in one block: only the mask is used
        slot_mapping=torch.arange(L - T, L), query_starts=[0], query_lens=[T], context_lens=[L],
        block_tables=[[0]], block_size=L, null_block=1,
    )
    chunk = _CPU_BACKEND.prefill_chunk(layout, 0)  # mask (T, L), or None for a fresh prompt (causal)
    y = _CPU_BACKEND.prefill_attention(q[0], k[0], v[0], chunk.mask, attn.scale)  # (nh, T, hd)
    return attn.c_proj(y.transpose(0, 1).reshape(B, T, C)), (k, v)


def minfer_own(owner: type, name: str):
    """minfer's own `owner.name`, or a sentence saying it moved (the exercise must follow it)."""
    if name not in vars(owner):
        raise SystemExit(f"the reference for an exercise is {owner.__name__}.{name}, which minfer no longer defines: "
                         "tutorials/exercises/plug.py, reference.py and the stub must follow it")
    return vars(owner)[name]


_SOLUTIONS = {  # stage -> the stub's function names -> minfer's own, looked up when the stage asks
    "03": lambda: {"attention_with_cache": attention_with_cache},
    "07": lambda: {"allocate": minfer_own(BlockAllocator, "allocate"), "free": minfer_own(BlockAllocator, "free")},
    "08": lambda: {"forward": minfer_own(TorchBackend, "forward")},
    "09": lambda: {
        "register_full_blocks": minfer_own(BlockAllocator, "register_full_blocks"),
        "match_prefix": minfer_own(BlockAllocator, "match_prefix"),
    },
    "10": lambda: {"admit": minfer_own(ContinuousBatcher, "_admit"),
                   "preempt": minfer_own(ContinuousBatcher, "_preempt")},
    "11": lambda: {"run": minfer_own(SchedulerManager, "_run")},
}


def solutions(stage: str) -> dict:
    """The functions exercise `stage` asks for, by the stub's names: minfer's own. Called before the plug
    replaces anything, so these are minfer's functions, not the plugged ones."""
    return _SOLUTIONS[stage]()
