"""Per-request sampling parameters and a batched token sampler.

Every row of a batch carries its own SamplingParams. The sampler turns a
(B, V) logits tensor into (B,) token ids without any host sync, so the engine
can do exactly one .tolist() per decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .errors import InvalidParameter, is_int


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means disabled
    top_p: float = 1.0  # 1.0 means disabled
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to list[str] or None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        """Check every field; a bad one raises InvalidParameter naming it."""
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidParameter("max_tokens", f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise InvalidParameter("temperature", f"temperature must be a number >= 0, got {t!r}")
        self.temperature = float(t)
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidParameter("top_k", f"top_k must be an int >= 0, got {self.top_k!r}")
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:  # also rejects nan
            raise InvalidParameter("top_p", f"top_p must be a number in (0, 1], got {p!r}")
        self.top_p = float(p)
        if self.seed is not None and not is_int(self.seed):
            raise InvalidParameter("seed", f"seed must be None or an int, got {self.seed!r}")
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameter("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _normalise_stop(stop) -> list[str] | None:
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise InvalidParameter("stop", f"stop must be None, a non-empty str or a list of non-empty str, got {stop!r}")
    return list(items)


def _normalise_stop_token_ids(ids) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not all(is_int(i) and i >= 0 for i in ids):
        raise InvalidParameter("stop_token_ids", f"stop_token_ids must be None or a list of ints >= 0, got {ids!r}")
    return list(ids)


_TOP_P_TOL = 1e-6  # float32 slack when comparing cumulative probability to top_p


def make_generator(seed: int | None, device) -> torch.Generator | None:
    """One generator per seeded request; None means "use the global RNG"."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64)  # torch accepts only 64-bit seeds
    return g


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set filtered entries to -inf. top_k: (B,) int, 0 = off; top_p: (B,) float, 1 = off.

    Top-k is applied first, then top-p over what top-k kept (the HF / vLLM order).
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(logits.shape[-1], device=logits.device)  # (V,)
    k = top_k.to(logits.device)[:, None]  # (B, 1)
    remove = (k > 0) & (ranks >= k)  # (B, V)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))

    probs = sorted_logits.float().softmax(dim=-1)  # (B, V) float32 for a stable cumsum
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly higher-ranked tokens
    p = top_p.to(device=logits.device, dtype=probs.dtype)[:, None]  # (B, 1)
    # The tolerance lets a set summing to exactly p (0.5 + 0.3 for p=0.8) count as
    # reaching it despite float32 rounding; p == 1 must keep every token.
    remove |= (mass_before >= p - _TOP_P_TOL) & (p < 1)
    remove[:, 0] = False  # the top token always survives

    mask = torch.empty_like(remove).scatter_(-1, sorted_idx, remove)  # back to vocab order
    return logits.masked_fill(mask, float("-inf"))


def _exponential_noise(n: int, v: int, device, generator=None) -> torch.Tensor:
    # Exp(1) as -log(U): on CPU ~5x faster than Tensor.exponential_ (13 vs 75 ms for 64 x 50257).
    u = torch.rand(n, v, device=device, dtype=torch.float32, generator=generator)  # [0, 1)
    e = u.neg_().log1p_().neg_()  # -log(1 - U), U < 1 so always finite
    # An exact 0 would turn probs / E into inf or nan; it is vanishingly rare anyway.
    return e.clamp_min_(torch.finfo(torch.float32).tiny)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row of `logits` (B, V). Returns (B,) int64 on logits.device."""
    B, V = logits.shape
    assert len(params) == B and len(generators) == B, "need one params and generator per row"
    device = logits.device
    logits = logits.float()  # (B, V) — bf16/fp16 are too coarse for softmax/cumsum

    greedy_tokens = logits.argmax(dim=-1)  # (B,) one argmax for all rows
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        return greedy_tokens

    # Temperature; greedy rows get 1.0 so they stay finite (their result is discarded).
    temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
    logits = logits / temps[:, None]  # (B, V)

    # Sorting 50k-wide rows is costly, so only rows with top-k/top-p pay for it.
    rows = [i for i, p in enumerate(params) if not greedy[i] and (p.top_k > 0 or p.top_p < 1)]
    if rows:
        idx = torch.tensor(rows, device=device)
        top_k = torch.tensor([params[i].top_k for i in rows], device=device)
        top_p = torch.tensor([params[i].top_p for i in rows], device=device)
        logits[idx] = apply_top_k_top_p(logits[idx], top_k, top_p)
    probs = logits.softmax(dim=-1)  # (B, V)

    # Exponential race: argmax(p / E), E ~ Exp(1), picks token i with probability p_i.
    # Seeded rows draw from their own generator so batch neighbours can't change them.
    noise = torch.ones(B, V, device=device)  # (B, V); greedy rows keep 1s, result discarded
    shared = [i for i, g in enumerate(generators) if g is None and not greedy[i]]
    if shared:
        noise[torch.tensor(shared, device=device)] = _exponential_noise(len(shared), V, device)
    for i, g in enumerate(generators):
        if g is not None and not greedy[i]:
            noise[i] = _exponential_noise(1, V, device, g)[0]
    sampled = (probs / noise).argmax(dim=-1)  # (B,)

    is_greedy = torch.tensor(greedy, device=device)
    return torch.where(is_greedy, greedy_tokens, sampled)
