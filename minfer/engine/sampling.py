"""The batched token sampler: a (B, V) logits tensor -> (B,) token ids, each row by its own SamplingParams.

It makes no host sync on a GPU, so the engine can do exactly one .tolist() per decode step. Greedy rows
take the argmax; the others divide by their temperature and draw by inverse CDF (draw.py), after the
controls that reshape the logits (logits_processors.py) and top-k / top-p (top_k_top_p.py) where asked.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..host_to_device import to_device
from .draw import draw_from
from .logits_processors import TokenHistory, apply_logits_controls, apply_min_p_rows
from .sampling_params import SamplingParams
from .top_k_top_p import draw_filtered


def make_generator(seed: int | None, device) -> torch.Generator | None:
    """One generator per seeded request; None means "use the global RNG"."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64)  # torch accepts only 64-bit seeds
    return g


def _uniforms(generators: Sequence[torch.Generator | None], params: Sequence[SamplingParams], device) -> torch.Tensor:
    """One uniform draw in [0, 1) per row (B,). A seeded row draws from its own generator, so its
    neighbours in the batch cannot change what it gets; the others share the global RNG."""
    u = torch.rand(len(params), device=device)
    for i, (g, p) in enumerate(zip(generators, params)):
        if g is not None and not p.is_greedy:
            u[i] = torch.rand(1, device=device, generator=g)[0]
    return u


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory] | None = None,
) -> torch.Tensor:
    """Pick one token per row of `logits` (B, V). Returns (B,) int64 on logits.device. `histories`, each
    row's tokens, are read only by the penalties and min_tokens (logits_processors.py)."""
    assert len(params) == logits.shape[0] and len(generators) == logits.shape[0], "need one params and generator per row"
    return sample_with(logits, params, lambda: _uniforms(generators, params, logits.device), histories)


def sample_with(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: Callable[[], torch.Tensor],
    histories: Sequence[TokenHistory] | None = None,
) -> torch.Tensor:
    """`sample`, its uniforms (B,) from `uniforms()`, called only if a row samples: speculative verification
    (speculative/verify.py) draws each row's token exactly as plain decoding would, from uniforms it chose."""
    device = logits.device
    controlled = any(p.uses_logits_controls for p in params)
    if controlled:  # logits_processors.py: logit_bias, min_tokens and the penalties, on an fp32 copy
        logits = apply_logits_controls(logits.to(torch.float32, copy=True), params, histories)
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        # Widening to fp32 is exact, so the bf16 row's maximum is the fp32 one's: skip the copy (a fresh
        # (B, V) fp32 tensor, page-faulted in: 17 ms at 64 x 151,936 on a CPU).
        return greedy_tokens(logits)
    # Dividing widens bf16/fp16 (too coarse for softmax/cumsum) into one fresh fp32 tensor (or the controls'
    # copy), changed in place from then on: on a CPU each fresh (B, V) tensor is page-faulted in, which cost
    # more than the arithmetic (16.8 ms at 64 x 50,257 with four). Greedy rows divide by 1: their draw is discarded.
    temps = to_device([1.0 if g else p.temperature for g, p in zip(greedy, params)], device)
    scaled = logits.div_(temps[:, None]) if controlled else logits / temps[:, None]  # (B, V) float32
    # (B,): the greedy rows' tokens; the drawn ones are overwritten below
    tokens = greedy_tokens(scaled) if any(greedy) else torch.empty(len(params), dtype=torch.long, device=device)
    if any(p.min_p for p in params):  # logits_processors.py: tokens far less likely than the likeliest go
        apply_min_p_rows(scaled, params)
    u = uniforms()  # (B,)
    plain = [i for i, p in enumerate(params) if not greedy[i] and p.top_k == 0 and p.top_p == 1]
    filtered = [i for i, p in enumerate(params) if not greedy[i] and (p.top_k > 0 or p.top_p < 1)]
    if plain:  # temperature only: the usual case
        rows = _rows(scaled, plain)  # scaled itself only when every row is plain: then none is filtered below
        weights = rows.sub_(rows.amax(dim=-1, keepdim=True)).exp_()  # softmax's numerators: draw_from normalises
        tokens[to_device(plain, device)] = draw_from(weights, _rows(u, plain))
    if filtered:
        top_k, top_p = [params[i].top_k for i in filtered], [params[i].top_p for i in filtered]
        tokens[to_device(filtered, device)] = draw_filtered(_rows(scaled, filtered), _rows(u, filtered), top_k, top_p)
    return tokens


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) the index of each row's largest logit, the first one on a tie (a NaN counts as
    largest), as argmax gives. max(dim).indices because it is 2.6-4x faster than argmax on a CPU
    (torch 2.13; 2.1 against 0.8 ms at 64 x 50,257 in fp32)."""
    return logits.max(dim=-1).indices


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] along the first dimension, without a copy when rows are all of them."""
    return x if len(rows) == x.shape[0] else x[to_device(rows, x.device)]
