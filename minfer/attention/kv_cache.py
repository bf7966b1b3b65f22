"""The paged KV cache's storage: preallocated tensors that attention writes and reads by slot.

Every layer's keys and values live in one preallocated tensor of `num_blocks * block_size` token slots. A
sequence owns a *block table*: the list of block ids that hold its tokens, in order, so token `p` of a
sequence lives in slot `table[p // block_size] * block_size + p % block_size` (`slot_of`) — the same trick
as virtual memory pages.

Which blocks a sequence holds is the engine's business (engine/block_allocator.py); this module only knows
slots and tensors; cache_budget.py, how many blocks a memory budget buys.
"""

from __future__ import annotations

import torch

from ..host_to_device import to_device
from ..model_config import ModelConfig


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: how many blocks hold `a` tokens (a partly filled block is still a block)."""
    return -(-a // b)


def slot_of(block_table, position, block_size: int):
    """The cache slot of token `position` of a sequence: table[p // block_size] * block_size + p % block_size.
    Takes a list table and an int position, or tensors: a (..., num_blocks) table and (L,) positions
    give (..., L) slots."""
    index = position // block_size
    block = block_table[..., index] if isinstance(block_table, torch.Tensor) else block_table[index]
    return block * block_size + position % block_size


def padded_tables(tables: list[list[int]], width: int, null_block: int) -> list[list[int]]:
    """Block tables cut or padded with the null block to `width` blocks each: one rectangle, for a tensor."""
    return [t[:width] + [null_block] * (width - len(t[:width])) for t in tables]


class KVCache:
    """The preallocated keys and values of every layer, in one tensor `kv` of shape (num_layers, num_slots,
    2, num_kv_heads, head_dim): a slot's key next to its value, so one gather of whole rows reads both
    (torch_sdpa.py). `k` and `v` are views of the two halves, (num_layers, num_slots, num_kv_heads,
    head_dim) each. With grouped-query attention only the key/value heads are stored. (A backend that
    reads another layout makes its own cache: AttentionBackend.new_cache.)

    Block `num_blocks` is an extra, never-allocated *null block*, kept zeroed: padded positions of a batched
    gather read it. Everything else starts uninitialised (torch.empty): a slot is always written before
    attention reads it unmasked, and untouched memory costs no RAM until used (`zeroed`: all of it zeroed,
    for a backend that reads unwritten slots of a sequence's last block and masks them by weight). Masked
    reads must still be finite (0 * NaN = NaN in the attention sum), hence the zeroed null block.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device, dtype, zeroed: bool = False):
        L, Hkv, D = config.num_layers, config.num_kv_heads, config.head_dim
        self.null_block, self.block_size = num_blocks, block_size
        with torch.inference_mode(False):  # a normal tensor whoever builds it: compiled kernels guard on the kind
            self.kv = self.allocate((L, (num_blocks + 1) * block_size, 2, Hkv, D), device, dtype, zeroed)
        self.kv[:, num_blocks * block_size :].zero_()
        self.k, self.v = self.kv[:, :, 0], self.kv[:, :, 1]  # (num_layers, num_slots, Hkv, D)

    @staticmethod
    def allocate(shape, device, dtype, zeroed: bool) -> torch.Tensor:
        return (torch.zeros if zeroed else torch.empty)(shape, device=device, dtype=dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (src, dst) block's keys and values, every layer. A dst named twice takes its last source."""
        if not pairs:
            return
        last = {dst: src for src, dst in pairs}  # dst -> its last src
        src, dst = self.block_rows(list(last.values())), self.block_rows(list(last.keys()))
        with torch.no_grad():
            self.kv[:, dst] = self.kv[:, src]  # (num_layers, P * block_size, ...)

    def block_rows(self, blocks: list[int]) -> torch.Tensor:
        """The indices along `kv`'s second axis that hold these blocks: block_size slots each."""
        offsets = torch.arange(self.block_size, device=self.kv.device)  # (block_size,)
        return (to_device(blocks, self.kv.device)[:, None] * self.block_size + offsets).flatten()

    @staticmethod
    def layer_elements_per_block(config: ModelConfig, block_size: int) -> int:
        """One block's keys and values in one layer: block_size slots of (2, Hkv, D)."""
        return 2 * block_size * config.num_kv_heads * config.head_dim

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * KVCache.layer_elements_per_block(config, block_size) * element
