"""Top-k and top-p (nucleus) filtering: the sampler's draw from each row's likeliest tokens only.

Top-k is applied first, then top-p over what top-k kept (the HF / vLLM order). Sorting 50k-wide rows is
what costs, so on a CPU only each row's head is sorted (`draw_filtered`). sampling.py calls it for the
rows that ask; rows that use neither never come here.
"""

from __future__ import annotations

import torch

from ..host_to_device import to_device
from .draw import draw_from

_TOP_P_TOL = 1e-6  # float32 slack when comparing cumulative probability to top_p
CPU_HEAD = 256  # on a CPU, top-k/top-p first sort only this many likeliest tokens per row (draw_filtered)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set filtered entries to -inf. top_k: (B,) int, 0 = off; top_p: (B,) float, 1 = off.

    Top-k is applied first, then top-p over what top-k kept (the HF / vLLM order).
    """
    V = logits.shape[-1]
    _, token_ids, kept, _ = kept_head(logits, top_k.to(logits.device), top_p.to(logits.device), V)  # (B, V)
    drop = torch.empty_like(kept).scatter_(-1, token_ids, ~kept)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


def kept_head(logits, top_k, top_p, K: int, row_log_total: torch.Tensor | None = None):
    """Top-k and top-p on the K likeliest tokens of each row (its head), most likely first.
    logits (R, V); top_k (R,) int, 0 = off; top_p (R,) float, 1 = off; row_log_total (R, 1), if known:
    logits.logsumexp(-1, keepdim=True). Returns, each (R, K) but the last: probs (renormalised over the
    top-k set; 0 where dropped), token_ids, kept (bool), and within (R,): whether the row's kept set lies
    inside its head."""
    if K == logits.shape[-1]:
        values, token_ids = logits.sort(dim=-1, descending=True)  # (R, V)
    else:
        values, token_ids = logits.topk(K, dim=-1)  # (R, K), sorted: far cheaper than sorting the row
    k, p = top_k[:, None], top_p.to(logits.dtype)[:, None]  # (R, 1)
    drop = (k > 0) & (torch.arange(K, device=logits.device) >= k)  # (R, K): past the k-th
    values = values.masked_fill(drop, float("-inf"))
    # Probabilities over the top-k set (inside the head: K >= k), or over the whole row when top-k is off.
    if row_log_total is None:
        row_log_total = logits.logsumexp(-1, keepdim=True)  # (R, 1): a pass over the whole row
    log_total = torch.where(k > 0, values.logsumexp(-1, keepdim=True), row_log_total)
    probs = (values - log_total).exp()  # (R, K)
    mass_through = probs.cumsum(dim=-1)  # (R, K) mass of each token and those ranked above it
    # The tolerance lets a set summing to exactly p (0.5 + 0.3 for p=0.8) count as
    # reaching it despite float32 rounding; p == 1 must keep every token.
    reached = p - _TOP_P_TOL
    drop |= (mass_through - probs >= reached) & (p < 1)
    drop[:, 0] = False  # the top token always survives
    # The head holds the whole top-k set; without top-k it holds the nucleus if its mass reaches p.
    within = (k[:, 0] > 0) | (p[:, 0] >= 1) | (mass_through[:, -1] >= reached[:, 0])  # (R,)
    return probs.masked_fill_(drop, 0.0), token_ids, ~drop, within


def draw_filtered(logits, u, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Draw from rows (R, V) of temperature-scaled logits that use top-k and/or top-p. Returns (R,) ids.

    Sorting 50k-wide rows is what costs here. On a CPU only each row's head is sorted (topk): its
    CPU_HEAD likeliest tokens, or top_k of them if more. A row whose nucleus reaches past its head is
    redone with a head 16 times larger, up to the whole row. Checking that reads a tensor: free on a
    CPU, but it would stall a GPU's queue, so a GPU sorts whole rows, which it does fast."""
    R, V = logits.shape
    device = logits.device
    top_k = [min(k, V) for k in top_k]  # a k past the vocabulary keeps all of it (and fits an int64)
    k = to_device(top_k, device)
    p = to_device(top_p, device)
    K = min(V, max(CPU_HEAD, *top_k)) if device.type == "cpu" else V
    tokens = torch.empty(R, dtype=torch.long, device=device)
    rows = torch.arange(R, device=device)  # the rows still to draw, and their inputs
    log_total = logits.logsumexp(-1, keepdim=True)  # (R, 1) once: a row redone below keeps its own
    x, k_rows, p_rows, u_rows, total_rows = logits, k, p, u, log_total
    while True:
        probs, token_ids, _, within = kept_head(x, k_rows, p_rows, K, total_rows)  # (r, K)
        tokens[rows] = token_ids.gather(1, draw_from(probs, u_rows)[:, None]).squeeze(1)
        if K == V or within.all():  # a CPU tensor: reading it costs nothing
            return tokens
        rows, K = rows[~within], min(V, 16 * K)
        x, k_rows, p_rows, u_rows, total_rows = logits[rows], k[rows], p[rows], u[rows], log_total[rows]
