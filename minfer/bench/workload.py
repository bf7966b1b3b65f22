"""What a benchmark sends: each request's prompt, how many tokens it must generate, and when it arrives.

Lengths are a number or a range `A:B`, drawn uniformly per request. Random prompts
are token ids drawn uniformly from the vocabulary minus its special tokens, and
every request runs with ignore_eos, so it produces exactly its output length.
Arrivals are a Poisson process (exponential gaps) or, at rate `inf`, all at t=0.
Everything is seeded: the same flags give the same workload on every engine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from ..text.tokenizer import Tokenizer

EOS = "<|endoftext|>"  # what separates the stories of a held-out text file
_RECORD = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}}}
# bench.py --structured-output: what every request's output must match (vLLM's structured_outputs). The
# array never ends before its 100,000th record, so every request still makes exactly its output length,
# and constrained runs compare with plain ones token for token.
STRUCTURED_OUTPUTS = {"json-schema": {"json": {"type": "array", "items": _RECORD, "minItems": 100_000}}}


@dataclass
class BenchRequest:
    index: int
    prompt: str | None  # text to send, or None when the prompt goes as token ids
    prompt_token_ids: list[int] | None  # ids to send: random prompts, or text tokenized up front (--pretok)
    input_len: int | None  # prompt tokens, counted outside the timed region (None: no tokenizer at hand)
    output_len: int  # tokens to generate, exactly
    arrival: float  # seconds after the run starts
    logprobs: int | None = None  # ask for each generated token's logprob and top-k (bench.py --logprobs k)
    structured_outputs: dict | None = None  # what the output must match (bench.py --structured-output)


def parse_length(spec: str | int, name: str = "length") -> tuple[int, int]:
    """'128' -> (128, 128); '32:256' -> (32, 256), both ends included."""
    try:
        lo, _, hi = str(spec).partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{name} must be a number or a range like 32:256, got {spec!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must be >= 1 with the low end first, got {spec!r}")
    return lo, hi


def sampleable_token_ids(tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Ids a random prompt may use: in the model's vocabulary, and not special (EOS has no bytes)."""
    table = tokenizer.token_bytes
    return [i for i in range(min(vocab_size, len(table))) if table[i]]


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrivals at `rate` requests/s, the first at 0; rate inf sends everything at once."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def utf8_text(path: Path, name: str) -> str:
    """The file's text; a ValueError naming it (`name`), the byte and its offset where it is not UTF-8 (the
    codec's own message names neither the file nor what is wrong with it)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}") from None


def read_prompts(prompts: list[str] | None, prompts_file: str | None) -> list[str]:
    """Text prompts from --prompt (repeatable) and --prompts-file (one per line, blank lines skipped)."""
    texts = list(prompts or [])
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompts file {prompts_file!r} does not exist")
        texts += [line for line in utf8_text(path, f"prompts file {prompts_file!r}").splitlines() if line.strip()]
        if not texts:
            raise ValueError(f"prompts file {prompts_file!r} holds no prompt")
    if any(not t for t in texts):
        raise ValueError("a prompt is empty")
    return texts


def copy_texts(model_dir: Path, num: int) -> list[str]:
    """The copy-heavy workload (`--workload copy`), where speculative decoding pays: two stories of the
    model's held-out text, then the first one's opening sentence again, so the answer tells a story like
    those it just read (minfer-tiny retells its grammar's phrases; minfer-tiny-llama copies it verbatim).
    Read from the checkpoint's heldout.txt (minfer-tiny ships one), stories separated by <|endoftext|>."""
    path = Path(model_dir) / "heldout.txt"
    if not path.is_file():
        raise ValueError(f"--workload copy reads held-out text from {path}, which does not exist (minfer-tiny has one)")
    stories = [s.strip() for s in path.read_text(encoding="utf-8").split(EOS) if s.strip()]
    return [copy_prompt(stories[2 * i % len(stories)], stories[(2 * i + 1) % len(stories)]) for i in range(num)]


def copy_prompt(first: str, second: str) -> str:
    """One copy prompt: both stories, each ended by <|endoftext|>, then the first one's opening sentence."""
    return f"{first}{EOS}{second}{EOS}{first.split('. ')[0]}."


def build_workload(
    num_requests: int,
    input_len: str,
    output_len: str,
    *,
    texts: list[str],
    tokenizer: Tokenizer | None,
    vocab_size: int | None,
    context: int | None,
    rate: float,
    seed: int,
    pretok: bool,
    run: int | str = 0,
    context_set_by: str | None = None,
) -> list[BenchRequest]:
    """The requests of one run. Lengths and arrivals depend on the seed alone, so repeated runs
    send the same shape of traffic; random prompt contents also depend on `run`, so a repeat does
    not simply hit the prefix cache filled by the run before. `context_set_by`: the flag that set a
    context shorter than the model's, named where a request does not fit."""
    if num_requests < 1:
        raise ValueError(f"num-requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    in_lo, in_hi = parse_length(input_len, "input-len")
    out_lo, out_hi = parse_length(output_len, "output-len")
    out_lens = [rng.randint(out_lo, out_hi) for _ in range(num_requests)]
    in_lens = [rng.randint(in_lo, in_hi) for _ in range(num_requests)]
    arrivals = arrival_times(num_requests, rate, rng)
    if texts and pretok and tokenizer is None:
        raise ValueError("--pretok needs the model's tokenizer: pass --tokenizer DIR")
    if not texts:
        if tokenizer is None or vocab_size is None:
            raise ValueError("random prompts need the model's tokenizer: pass --model DIR (or --tokenizer DIR)")
        ids = sampleable_token_ids(tokenizer, vocab_size)
        content = random.Random(f"{seed}/{run}")
    limit = f"the context of {context} ({context_set_by})" if context_set_by else f"the model's context of {context}"
    requests = []
    for i in range(num_requests):
        if texts:
            text = texts[i % len(texts)]
            token_ids = tokenizer.encode_prompt(text) if tokenizer else None
            n_in = len(token_ids) if token_ids is not None else None
            prompt, sent_ids = (None, token_ids) if pretok and token_ids else (text, None)
        else:
            n_in = in_lens[i]
            prompt, sent_ids = None, [content.choice(ids) for _ in range(n_in)]
        if context and n_in and n_in + out_lens[i] > context:
            raise ValueError(
                f"request {i}: {n_in} prompt tokens + {out_lens[i]} output tokens exceed {limit}; "
                "lower --input-len/--output-len"
            )
        requests.append(BenchRequest(i, prompt, sent_ids, n_in, out_lens[i], arrivals[i]))
    return requests


def warmup_workload(
    requests: list[BenchRequest], tokenizer: Tokenizer | None, vocab_size: int | None, num: int = 4
) -> list[BenchRequest]:
    """A few requests shaped like the first ones, all at t=0, with fresh random ids where a tokenizer
    is at hand: they warm the engine up without seeding its prefix cache with the measured prompts."""
    warm = []
    ids = sampleable_token_ids(tokenizer, vocab_size) if tokenizer and vocab_size else None
    rng = random.Random("warmup")
    for r in requests[:num]:
        if ids and r.input_len:
            warm.append(
                BenchRequest(
                    r.index,
                    None,
                    [rng.choice(ids) for _ in range(r.input_len)],
                    r.input_len,
                    min(r.output_len, 16),
                    0.0,
                )
            )
        else:
            warm.append(BenchRequest(r.index, r.prompt, r.prompt_token_ids, r.input_len, min(r.output_len, 16), 0.0))
    return warm
