"""Per-request sampling parameters and a batched token sampler.

Every row of a batch carries its own SamplingParams. The sampler turns a
(B, V) logits tensor into (B,) token ids without any host sync on a GPU, so the
engine can do exactly one .tolist() per decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import InvalidParameter, is_int
from ..host_to_device import to_device
from .logits_processors import TokenHistory, apply_logits_controls, apply_min_p


MAX_LOGPROBS = 20  # the most top tokens a request may ask for per position (OpenAI's limit)


def check_num_logprobs(value, name: str) -> None:
    """None (not asked) or an int in [0, MAX_LOGPROBS]; else InvalidParameter naming `name`."""
    if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise InvalidParameter(name, f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")


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
    logprobs: int | None = None  # per generated token: its logprob and the k likeliest (scoring/)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    n: int = 1  # completions of the one prompt (seeded: choice i uses seed + i); parallel_sampling/ shares its blocks
    # The controls below follow vLLM's semantics (logits_processors.py applies them).
    presence_penalty: float = 0.0  # [-2, 2]: minus this for every token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # > 0: a token seen in prompt or output has its logit divided (>0) or multiplied (<=0)
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the likeliest one
    logit_bias: dict[int, float] | None = None  # {token id: bias in [-100, 100]} added to the logits
    min_tokens: int = 0  # no stop token, EOS or stop string can end the output before this many tokens
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    skip_special_tokens: bool = True  # special tokens add no text

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
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameter(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        check_num_logprobs(self.logprobs, "logprobs")
        check_num_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if not is_int(self.n) or self.n < 1:
            raise InvalidParameter("n", f"n must be an int >= 1, got {self.n!r}")
        self.presence_penalty = _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            raise InvalidParameter("repetition_penalty", f"repetition_penalty must be a number > 0, got {r!r}")
        self.repetition_penalty = float(r)
        self.min_p = _number_in("min_p", self.min_p, 0.0, 1.0)
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParameter(
                "min_tokens", f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )

    @property
    def uses_logits_controls(self) -> bool:
        """Whether any control that reshapes the logits before the draw is on (min_p apart)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens
        )

    @property
    def wants_logprobs(self) -> bool:
        """Whether the request asks for logprobs of its tokens or of its prompt (scoring/)."""
        return self.logprobs is not None or self.prompt_logprobs is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _number_in(name: str, x, low: float, high: float) -> float:
    if not _is_number(x) or not low <= x <= high:  # also rejects nan
        raise InvalidParameter(name, f"{name} must be a number in [{low:g}, {high:g}], got {x!r}")
    return float(x)


def _normalise_logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias}; whether the ids are in the vocabulary is the scheduler's to check."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidParameter("logit_bias", f"logit_bias must be a dict {{token id: bias}}, got {bias!r}")
    for token, b in bias.items():
        if not is_int(token) or token < 0:
            raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if not _is_number(b) or not -100 <= b <= 100:
            raise InvalidParameter("logit_bias", f"logit_bias[{token}] must be a number in [-100, 100], got {b!r}")
    return {token: float(b) for token, b in bias.items()} or None


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
CPU_HEAD = 256  # on a CPU, top-k/top-p first sort only this many likeliest tokens per row (_draw_filtered)


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
    V = logits.shape[-1]
    _, token_ids, kept, _ = _kept_head(logits, top_k.to(logits.device), top_p.to(logits.device), V)  # (B, V)
    drop = torch.empty_like(kept).scatter_(-1, token_ids, ~kept)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


def _kept_head(logits, top_k, top_p, K: int, row_log_total: torch.Tensor | None = None):
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


def draw_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: for each row of probs (R, K), which need not sum to 1, the first index
    whose cumulative probability passes u (R,) in [0, 1) times the row's total. Index i comes up with
    probability probs[i] / total, and a zero entry never does. probs is overwritten."""
    cdf = probs.cumsum_(dim=-1)  # (R, K), non-decreasing
    total = cdf[:, -1:]  # (R, 1)
    target = torch.minimum(u[:, None] * total, total.nextafter(torch.zeros_like(total)))  # < total, even rounded
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # (R,)


def _draw_filtered(logits, u, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Draw from rows (R, V) of temperature-scaled logits that use top-k and/or top-p. Returns (R,) ids.

    Sorting 50k-wide rows is what costs here. On a CPU only each row's head is sorted (topk): its
    CPU_HEAD likeliest tokens, or top_k of them if more. A row whose nucleus reaches past its head is
    redone with a head 16 times larger, up to the whole row. Checking that reads a tensor: free on a
    CPU, but it would stall a GPU's queue, so a GPU sorts whole rows, which it does fast."""
    R, V = logits.shape
    device = logits.device
    k = to_device(top_k, device)
    p = to_device(top_p, device)
    K = min(V, max(CPU_HEAD, *top_k)) if device.type == "cpu" else V
    tokens = torch.empty(R, dtype=torch.long, device=device)
    rows = torch.arange(R, device=device)  # the rows still to draw, and their inputs
    log_total = logits.logsumexp(-1, keepdim=True)  # (R, 1) once: a row redone below keeps its own
    x, k_rows, p_rows, u_rows, total_rows = logits, k, p, u, log_total
    while True:
        probs, token_ids, _, within = _kept_head(x, k_rows, p_rows, K, total_rows)  # (r, K)
        tokens[rows] = token_ids.gather(1, draw_from(probs, u_rows)[:, None]).squeeze(1)
        if K == V or within.all():  # a CPU tensor: reading it costs nothing
            return tokens
        rows, K = rows[~within], min(V, 16 * K)
        x, k_rows, p_rows, u_rows, total_rows = logits[rows], k[rows], p[rows], u[rows], log_total[rows]


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
    """Pick one token per row of `logits` (B, V). Returns (B,) int64 on logits.device.

    Rows that ask get logit_bias, min_tokens and the penalties first (logits_processors.py; they read
    `histories`, each row's tokens). Greedy rows then take the argmax. The others divide by their
    temperature, keep what min_p, top-k and top-p leave, and draw by inverse CDF: one uniform per row
    against the cumulative probabilities (see draw_from)."""
    assert len(params) == logits.shape[0] and len(generators) == logits.shape[0], "need one params and generator per row"
    return sample_with(logits, params, lambda: _uniforms(generators, params, logits.device), histories)


def sample_with(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: Callable[[], torch.Tensor],
    histories: Sequence[TokenHistory] | None = None,
) -> torch.Tensor:
    """`sample`, its uniforms (B,) from `uniforms()`, called only if a row samples: speculative verification
    (speculative/verify.py) draws each row's token exactly as plain decoding would, from uniforms it
    chose itself."""
    B = logits.shape[0]
    device = logits.device
    controlled = any(p.uses_logits_controls for p in params)
    greedy = [p.is_greedy for p in params]
    if not controlled and all(greedy):
        # Widening to fp32 is exact, so the bf16 row's maximum is the fp32 one's: skip the copy (a fresh
        # (B, V) fp32 tensor, page-faulted in: 17 ms at 64 x 151,936 on a CPU).
        return greedy_tokens(logits)
    # One fp32 copy, then in place: on a CPU each fresh (B, V) tensor is page-faulted in (glibc maps large
    # blocks afresh), which cost more than the arithmetic (16.8 ms at 64 x 50,257 with four of them).
    logits = logits.to(torch.float32, copy=True)  # (B, V) — bf16/fp16 are too coarse for softmax/cumsum
    if controlled:
        assert histories is not None and len(histories) == B, "penalties and min_tokens need each row's tokens"
        logits = apply_logits_controls(logits, params, histories)
    # (B,): the greedy rows' tokens; the sampled ones are overwritten below
    tokens = greedy_tokens(logits) if any(greedy) else torch.empty(B, dtype=torch.long, device=device)
    if all(greedy):
        return tokens

    # Greedy rows get temperature 1 so they stay finite (their draw is discarded).
    temps = to_device([1.0 if p.is_greedy else p.temperature for p in params], device)
    scaled = logits.div_(temps[:, None])  # (B, V)
    with_min_p = [i for i, p in enumerate(params) if not p.is_greedy and p.min_p > 0]
    if with_min_p:
        index = _index(with_min_p, device)
        min_p = to_device([params[i].min_p for i in with_min_p], device)
        scaled[index] = apply_min_p(scaled[index], min_p)
    u = uniforms()  # (B,)
    plain = [i for i, p in enumerate(params) if not p.is_greedy and p.top_k == 0 and p.top_p == 1]
    filtered = [i for i, p in enumerate(params) if not p.is_greedy and (p.top_k > 0 or p.top_p < 1)]
    if plain:  # temperature only: the usual case
        rows = _rows(scaled, plain)  # scaled itself only when every row is plain: then none is filtered below
        weights = rows.sub_(rows.amax(dim=-1, keepdim=True)).exp_()  # softmax's numerators: draw_from normalises
        tokens[_index(plain, device)] = draw_from(weights, _rows(u, plain))
    if filtered:
        top_k, top_p = [params[i].top_k for i in filtered], [params[i].top_p for i in filtered]
        tokens[_index(filtered, device)] = _draw_filtered(_rows(scaled, filtered), _rows(u, filtered), top_k, top_p)
    return tokens


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) the index of each row's largest logit, the first one on a tie (a NaN counts as
    largest), as argmax gives. max(dim).indices because it is 2.6-4x faster than argmax on a CPU
    (torch 2.13; 2.1 against 0.8 ms at 64 x 50,257 in fp32)."""
    return logits.max(dim=-1).indices


def _index(rows: list[int], device) -> torch.Tensor:
    return to_device(rows, device)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] along the first dimension, without a copy when rows are all of them."""
    return x if len(rows) == x.shape[0] else x[_index(rows, x.device)]
