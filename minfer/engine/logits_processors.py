"""The sampling controls that reshape a batch's logits before the draw, with vLLM's semantics.

vLLM's sampler (v1/sample/sampler.py) runs, on float32 logits:
1. logit_bias (added) and min_tokens (stop tokens at -inf until the output is long enough);
2. the penalties (vllm/model_executor/layers/utils.py `apply_penalties`):
   - repetition_penalty over every token seen in the prompt *or* the output: a positive logit
     is divided by it, a non-positive one multiplied;
   - frequency_penalty times the token's count in the output, subtracted;
   - presence_penalty for every token present in the output, subtracted;
3. greedy rows take the argmax of that; the others divide by their temperature, then
4. min_p: tokens whose probability is below min_p x the row's highest are dropped; then top-k, top-p.

`sample_controlled` samples a batch where any row uses them (sampling.py hands it over): `apply_logits_controls`
does steps 1 and 2, `apply_min_p_rows` step 4, top_k_top_p.py the rest. Each works
on the rows that use it, with tensor ops over the whole vocabulary (no loop over vocabulary entries):
a row that uses none costs nothing. Counts come from each row's token history, read fresh every step,
so a preempted and recomputed sequence, or a forked one, gets exactly the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Protocol

import torch

from ..host_to_device import to_device
from .draw import draw_from_logits, greedy_tokens, temperatures
from .sampling_params import GREEDY_TEMPERATURE
from .top_k_top_p import draw_filtered


class TokenHistory(Protocol):
    """What the controls read of a row's sequence (engine/sequence.py's Sequence has it)."""

    token_ids: list[int]  # prompt, then output
    num_prompt_tokens: int
    min_tokens_stop_ids: list[int]  # what min_tokens holds back: stop_token_ids and the EOS ids


def sample_controlled(
    logits: torch.Tensor, params: Sequence, uniforms: Callable[[], torch.Tensor], histories: Sequence[TokenHistory]
) -> torch.Tensor:
    """sampling.py's `sample_with` for a batch where some row uses the controls: logits (B, V) -> (B,) tokens."""
    device = logits.device
    controlled = any(p.uses_logits_controls for p in params)
    if controlled:  # steps 1 and 2, on an fp32 copy
        logits = apply_logits_controls(logits.to(torch.float32, copy=True), params, histories)
    greedy = [p.is_greedy for p in params]
    if all(greedy):
        return greedy_tokens(logits)
    # One fresh fp32 tensor (or the controls' copy), changed in place from then on: on a CPU each fresh
    # (B, V) tensor is page-faulted in, which costs more than the arithmetic.
    temps = temperatures(params, greedy, device)[:, None]  # (B, 1)
    scaled = logits.div_(temps) if controlled else logits / temps  # (B, V) float32
    # (B,): the greedy rows' tokens; the drawn ones are overwritten below
    tokens = greedy_tokens(scaled) if any(greedy) else torch.empty(len(params), dtype=torch.long, device=device)
    if any(p.min_p for p in params):
        apply_min_p_rows(scaled, params)
    u = uniforms()  # (B,)
    plain = [i for i, p in enumerate(params) if not greedy[i] and p.top_k == 0 and p.top_p == 1]
    filtered = [i for i, p in enumerate(params) if not greedy[i] and (p.top_k > 0 or p.top_p < 1)]
    if plain:  # temperature only
        # scaled itself only when every row is plain: then none is filtered below
        tokens[to_device(plain, device)] = draw_from_logits(_rows(scaled, plain), _rows(u, plain))
    if filtered:
        top_k, top_p = [params[i].top_k for i in filtered], [params[i].top_p for i in filtered]
        tokens[to_device(filtered, device)] = draw_filtered(_rows(scaled, filtered), _rows(u, filtered), top_k, top_p)
    return tokens


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] along the first dimension, without a copy when rows are all of them."""
    return x if len(rows) == x.shape[0] else x[to_device(rows, x.device)]


def apply_logits_controls(logits: torch.Tensor, params: Sequence, histories: Sequence[TokenHistory]) -> torch.Tensor:
    """logit_bias, min_tokens and the penalties, on the rows whose params use them. logits: (B, V) float32,
    changed in place and returned; histories: each row's tokens."""
    assert histories is not None and len(histories) == len(params), "penalties and min_tokens need each row's tokens"
    rows = [i for i, p in enumerate(params) if p.uses_logits_controls]
    if not rows:
        return logits
    device, V = logits.device, logits.shape[1]
    index = to_device(rows, device)
    x = logits[index]  # (R, V): a copy, written back below
    row_params = [params[i] for i in rows]
    row_histories = [histories[i] for i in rows]
    _add_logit_bias(x, row_params)
    _mask_min_tokens(x, row_params, row_histories)
    penalised = [
        r for r, p in enumerate(row_params) if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1
    ]
    if penalised:
        sub = to_device(penalised, device)
        x[sub] = apply_penalties(x[sub], [row_params[r] for r in penalised], [row_histories[r] for r in penalised], V)
    logits[index] = x
    return logits


def _add_logit_bias(x: torch.Tensor, params: Sequence) -> None:
    rows, tokens, biases = [], [], []
    for r, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(r)
            tokens.append(token)
            biases.append(bias)
    if rows:
        idx = (to_device(rows, x.device), to_device(tokens, x.device))
        x.index_put_(idx, to_device(biases, x.device, x.dtype), accumulate=True)


def _mask_min_tokens(x: torch.Tensor, params: Sequence, histories: Sequence[TokenHistory]) -> None:
    rows, tokens = [], []
    for r, (p, h) in enumerate(zip(params, histories)):
        if len(h.token_ids) - h.num_prompt_tokens < p.min_tokens:
            rows += [r] * len(h.min_tokens_stop_ids)
            tokens += h.min_tokens_stop_ids
    if rows:
        # A device scalar: `x[...] = float("-inf")` copies the scalar to the GPU, a host sync.
        forbidden = torch.full((), float("-inf"), dtype=x.dtype, device=x.device)
        x.index_put_((to_device(rows, x.device), to_device(tokens, x.device)), forbidden)


def token_counts(histories: Sequence[TokenHistory], V: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row: how often each vocabulary entry occurs in the output, and whether it occurs in the
    prompt. Both (R, V); one bincount over flat (row, token) indices, built once per step."""
    R = len(histories)
    out_flat, prompt_flat = [], []
    for r, h in enumerate(histories):
        base, n = r * V, h.num_prompt_tokens
        prompt_flat += [base + t for t in h.token_ids[:n]]
        out_flat += [base + t for t in h.token_ids[n:]]
    output_counts = _count(out_flat, R * V, device)
    in_prompt = _count(prompt_flat, R * V, device) > 0
    return output_counts.view(R, V), in_prompt.view(R, V)


def _count(flat: list[int], size: int, device) -> torch.Tensor:
    """How often each of `size` indices occurs in `flat`: a bincount without bincount's host sync on a GPU
    (it reads the largest index to size its output)."""
    index = to_device(flat, device, torch.long)
    return torch.zeros(size, dtype=torch.long, device=device).index_add_(0, index, torch.ones_like(index))


def apply_penalties(x: torch.Tensor, params: Sequence, histories: Sequence[TokenHistory], V: int) -> torch.Tensor:
    """Repetition (prompt and output), frequency and presence (output only) penalties. x: (R, V)."""
    output_counts, in_prompt = token_counts(histories, V, x.device)  # (R, V) each

    def column(values: list[float]) -> torch.Tensor:  # (R, 1)
        return to_device(values, x.device, x.dtype)[:, None]

    # Any penalty > 0 is allowed, as in vLLM, but in x's dtype 1e-300 is 0 and 1e300 inf: kept finite and
    # nonzero, and a penalised logit kept below what the smallest temperature can still divide, so that no
    # penalty makes a NaN (0 * inf, or inf less its row's maximum when drawing).
    finite = torch.finfo(x.dtype)
    repetition = column([p.repetition_penalty for p in params]).clamp_(finite.tiny, finite.max)
    seen = in_prompt | (output_counts > 0)
    penalty = torch.where(seen, repetition, 1.0)  # (R, V)
    x = torch.where(x > 0, (x / penalty).clamp_(max=finite.max * GREEDY_TEMPERATURE), x * penalty)
    x -= column([p.frequency_penalty for p in params]) * output_counts
    x -= column([p.presence_penalty for p in params]) * (output_counts > 0)
    return x


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (-inf) tokens whose probability is below min_p x the row's likeliest. scaled: (R, V)
    temperature-scaled logits; min_p: (R,), 0 = off."""
    probs = scaled.softmax(dim=-1)  # (R, V)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # (R, 1)
    return scaled.masked_fill(probs < threshold, float("-inf"))


def apply_min_p_rows(scaled: torch.Tensor, params: Sequence) -> None:
    """apply_min_p, in place, on the rows of scaled (B, V) whose params ask for min_p. A greedy row's token
    is taken before: min_p never drops the likeliest token anyway."""
    rows = [i for i, p in enumerate(params) if p.min_p > 0]
    index = to_device(rows, scaled.device)
    scaled[index] = apply_min_p(scaled[index], to_device([params[i].min_p for i in rows], scaled.device))
