"""The batched token sampler: a (B, V) logits tensor -> (B,) token ids, each row by its own SamplingParams.

It makes no host sync on a GPU, so the engine can do exactly one .tolist() per decode step. Greedy rows
take the argmax; the others divide by their temperature and draw by inverse CDF (draw.py). A batch where
any row asks for more (penalties, logit_bias, min_tokens, min_p, top-k, top-p) is sampled by
logits_processors.py's `sample_controlled` instead.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..host_to_device import to_device
from .draw import draw_from_logits, greedy_tokens, temperatures
from .logits_processors import TokenHistory, sample_controlled
from .sampling_params import SamplingParams


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


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           histories: Sequence[TokenHistory] | None = None) -> torch.Tensor:
    """Pick one token per row of `logits` (B, V). Returns (B,) int64 on logits.device. `histories`, each
    row's tokens, are read only by the penalties and min_tokens (logits_processors.py)."""
    assert len(params) == len(generators) == logits.shape[0], "need one params and generator per row"
    return sample_with(logits, params, lambda: _uniforms(generators, params, logits.device), histories)


def sample_with(logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Callable[[], torch.Tensor],
                histories: Sequence[TokenHistory] | None = None) -> torch.Tensor:
    """`sample`, its uniforms (B,) from `uniforms()`, called only if a row samples: speculative verification
    (speculative/verify.py) draws each row's token exactly as plain decoding would, from uniforms it chose."""
    if any(p.uses_sampling_controls for p in params):  # logits_processors.py: penalties, min_p, top-k, ...
        return sample_controlled(logits, params, uniforms, histories)
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        return greedy_tokens(logits)  # widening bf16 to fp32 is exact: the same row maximum, no copy
    greedy_picks = greedy_tokens(logits) if any(greedy) else None  # (B,)
    scaled = logits / temperatures(params, greedy, logits.device)[:, None]  # (B, V) fp32: bf16 is too coarse
    drawn = draw_from_logits(scaled, uniforms())  # (B,)
    return drawn if greedy_picks is None else torch.where(to_device(greedy, logits.device), greedy_picks, drawn)
