"""flex_attention compiled as the flex backend (flex.py) calls it: once per process, and, where it serves
(a GPU), for exactly the shapes the engine's steps give it.

Where it serves, flex_attention compiles with dynamic shapes, so batch sizes and context lengths reuse one
kernel. Dynamo still compiles anew for what it guards on: a size of 1 (a lone sequence, one query tile),
strides, the kind of tensor (inference or not), each distinct `kernel_options`, and sizes that were equal
when it compiled (duck sizing). The backend gives it one layout (q made contiguous, tables at least two
blocks wide), and the engine's warm-up (warm_up.py) runs one step of each remaining kind through the model
before the first request. Past Dynamo's recompile limit (8 by default) flex_attention would run unfused,
scoring every slot of the cache: where the warm-ups compile, the limit is raised, as vLLM raises it, and
hitting it raises an error instead of a silent unfused run. After them, a recompile raises (`sealed`): a
path failure (forward.py).

On a CPU, where only tests choose flex, it compiles without dynamic shapes (torch 2.13's C++ template
failed to build with dynamic sizes and the block mask). tests/conftest.py's `flex_traced_as_on_a_gpu` runs
the serving path on a CPU through Dynamo's eager backend: the same guards and recompiles, no kernels.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

QUERY_TILE = 128  # query rows per tile of a BlockMask (FlexAttention's own default)
SERVING_DEVICES = ("cuda",)  # where flex compiles for serving: dynamic shapes, warmed up, sealed
SERVING_BACKEND = "inductor"  # the compiler there (the tests' CPU emulation: "eager")
RECOMPILE_LIMIT = 64  # compiles of flex_attention a process may hold (Dynamo's default: 8)
# The torch that flex's paged use needs: BlockMask.from_kv_blocks(compute_q_blocks=False) and 16-token key
# blocks in the Triton kernels (earlier, BLOCK_N had to be 64 or more).
MIN_TORCH = (2, 9)
_compiled: dict = {}  # ("dynamic" or "static", backend) -> the compiled flex_attention, made on first use


def serves_on(device: torch.device) -> bool:
    """Whether flex compiles there as it serves (dynamic shapes, warmed up through engine steps)."""
    return device.type in SERVING_DEVICES


def compiled_flex_attention(dynamic: bool):
    """torch.compile(flex_attention): with dynamic shapes where it serves, else per shape. One of each per process."""
    key = ("dynamic" if dynamic else "static", SERVING_BACKEND if dynamic else "inductor")
    if key not in _compiled:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled[key] = torch.compile(flex_attention, dynamic=dynamic, backend=key[1])
    return _compiled[key]


def kernel_options(query_len: int, key_block: int) -> dict:
    """Triton's tiles. A key tile must divide a cache block (torch refuses otherwise; its defaults are 64 and
    up, minfer's blocks 16), and a decode query or a short chunk needs no 128-row tile. Two buckets, by
    query length: each is one more compile, and the warm-up compiles both."""
    options = {"BLOCK_N": math.gcd(key_block, 64)}
    if query_len <= 16:
        options["BLOCK_M"] = 16
    return options


def torch_too_old() -> str | None:
    """Why this torch cannot serve flex's paged attention, or None."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return f"FlexAttention over 16-token cache blocks needs torch >= {need}, and this is {torch.__version__}"
    return None


@contextmanager
def compiling_for_serving():
    """Around a warm-up's compiles, in the thread that compiles (Dynamo's settings are the thread's own):
    - room for every kind of step, of every engine in the process (five or so each), and an error past it;
    - sizes that happen to be equal in a warm-up step (a batch and a table's width) are not assumed equal
      ever after (duck sizing off), else the next step where they differ recompiles."""
    import torch._dynamo.config as dynamo_config  # here: importing Dynamo costs every `minfer` start a second
    import torch.fx.experimental._config as fx_config

    limits = {"recompile_limit": RECOMPILE_LIMIT, "fail_on_recompile_limit_hit": True}
    with dynamo_config.patch(**limits), fx_config.patch(use_duck_shape=False):
        yield


@contextmanager
def sealed():
    """Around a served step once the warm-up has compiled: a recompile raises instead (a path failure)."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield
