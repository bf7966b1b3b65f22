"""Baseline: the same workload through transformers' `generate`, in static batches.

This is what people do without an inference engine: take `--hf-batch-size` requests
in order, left-pad their prompts, and generate greedily until the longest of them
is done (min_new_tokens = max_new_tokens, the equivalent of ignore_eos). Every
request is submitted at t=0, as with `--request-rate inf`; a batch starts when the
one before it ends.

Times are real measurements: a stopping-criteria callback timestamps every generated
step of the batch. A request counts only its own output length as useful tokens;
its last token is the step that reached that length (as if streamed: `generate`
itself hands results back only when the whole batch ends), so its latency, TPOT and
ITL are what a streaming client would see. transformers is imported only here.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from .metrics import RequestRecord, RunResult


def load_hf_model(model_dir, device: str, dtype: torch.dtype, progress: bool = True):
    try:
        import transformers
    except ImportError:
        raise ImportError("--baseline hf needs transformers: pip install transformers") from None
    if not progress:
        transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))  # the class config.json names
    return model.to(device=device, dtype=dtype).eval()


def _step_clock(device: torch.device):
    """A stopping criterion that never stops and records when each step's token was chosen."""
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the token exists only once the GPU is done
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> list[float]:
    """Greedy generation of exactly max_new_tokens for every prompt; returns each step's timestamp."""
    from transformers import StoppingCriteriaList

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    clock = _step_clock(model.device)
    model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        stopping_criteria=StoppingCriteriaList([clock]),
    )
    if len(clock.times) < max_new_tokens:
        raise RuntimeError(f"generate took {len(clock.times)} steps for {max_new_tokens} tokens")
    return clock.times


def run_hf(
    model, prompts: list[list[int]], output_lens: list[int], batch_size: int, pad_id: int, progress: bool = True
) -> RunResult:
    """prompts[i] (token ids, tokenized beforehand) generates output_lens[i] tokens."""
    if batch_size < 1:
        raise ValueError(f"hf-batch-size must be >= 1, got {batch_size}")
    records = []
    t0 = time.perf_counter()
    with tqdm(total=len(prompts), desc="hf generate", unit="req", disable=not progress) as bar:
        for b in range(0, len(prompts), batch_size):
            idx = range(b, min(b + batch_size, len(prompts)))
            start = time.perf_counter() - t0
            times = generate_batch(model, [prompts[i] for i in idx], max(output_lens[i] for i in idx), pad_id)
            times = [t - t0 for t in times]
            for i in idx:
                n = output_lens[i]
                records.append(
                    RequestRecord(
                        i,
                        len(prompts[i]),
                        n,
                        output_len=n,
                        submit_time=0.0,
                        scheduled_time=start,
                        first_token_time=times[0],
                        finish_time=times[n - 1],
                        itl=[y - x for x, y in zip(times[: n - 1], times[1:n])],
                    )
                )
            bar.update(len(idx))
    return RunResult(records, time.perf_counter() - t0, [])


# (summary key, label, unit, whether higher is better)
RATIOS = (
    ("output_throughput", "Output token throughput", "tok/s", True),
    ("total_token_throughput", "Total token throughput", "tok/s", True),
    ("mean_tpot_ms", "Mean TPOT", "ms", False),
    ("median_tpot_ms", "Median TPOT", "ms", False),
    ("mean_ttft_ms", "Mean TTFT", "ms", False),
)


def compare(minfer: dict, hf: dict) -> dict[str, float | None]:
    """minfer / baseline for throughputs (above 1: minfer wins) and latencies (below 1: minfer wins)."""
    return {key: minfer[key] / hf[key] if minfer.get(key) and hf.get(key) else None for key, *_ in RATIOS}


def verdict(minfer: float | None, hf: float | None, higher_is_better: bool) -> str:
    """'minfer is 1.99x faster' or '... slower': one direction, whatever the metric's."""
    if not minfer or not hf:
        return "n/a"
    speedup = minfer / hf if higher_is_better else hf / minfer
    return f"minfer is {speedup:.2f}x faster" if speedup >= 1 else f"minfer is {1 / speedup:.2f}x slower"


def format_comparison(minfer: dict, hf: dict, batch_size: int) -> str:
    lines = [f"{' minfer vs transformers (batch ' + str(batch_size) + ') ':=^72}"]
    for key, label, unit, higher in RATIOS:
        both = minfer.get(key) is not None and hf.get(key) is not None
        figures = f" ({minfer[key]:.1f} vs {hf[key]:.1f} {unit})" if both else ""
        lines.append(f"{label + ':':<26}{verdict(minfer.get(key), hf.get(key), higher)}{figures}")
    return "\n".join(lines + ["=" * 72])
