"""Where an engine step's time goes: `python bench.py --profile`.

The workload's requests are added at once (up to max_num_seqs run together) and
two windows of steps are timed: the first steps, where the prompts are prefilled
(next to whatever already decodes), and steps of steady decoding once every
prompt is in. Each step is split into the parts the engine marks (step_timing.PARTS)
(host-side scheduling and preparation, KV write, context read (the gather),
attention, sampling, bookkeeping), plus the linears and the LM head, timed by
hooks on their modules; the rest of the step's wall time is the small ops in
between (layer norms, GELU, residual adds, embeddings) and Python between ops.

Beside each part: the bytes it must move and the FLOPs it must do, what rate
that comes to, and which one bounds it on this machine: the time the bytes would
take at the measured read bandwidth, or the FLOPs at the measured matmul rate,
whichever is longer, is that part's floor.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict

import torch

from .. import step_parts
from . import step_timing
from ..engine.scheduler import OnlineScheduler
from ..quantization import quantization_of
from .offline import submit_request
from .roofline import best_time, measure_bandwidth, module_bytes, weight_linears, weights_name
from .workload import BenchRequest

REST = "norms, GELU, residuals, Python"  # the step's wall time that no part covers
PART_WIDTH = len(REST) + 1  # the table's first column: the longest part name, then a space
ROWS = (
    "host: schedule",
    "host: prepare",
    "KV write",
    "context read",
    "attention",
    "linears",
    "LM head",
    "sampling",
    "host: bookkeeping",
    "speculation: propose",
    "speculation: verify",
    REST,
)
OPTIONAL_ROWS = ("speculation: propose", "speculation: verify")  # marked by speculative decoding alone


def profile_steps(scheduler: OnlineScheduler, requests: list[BenchRequest], num_steps: int = 6) -> dict:
    """Run the requests, timing `num_steps` prefill-phase steps and `num_steps` steady decode steps."""
    ids = [submit_request(scheduler, r) for r in requests]
    try:
        prefill = _record(scheduler, num_steps)
        # Then run on until the batch decodes steadily: nothing waiting, no prompt left to prefill.
        while scheduler.has_unfinished() and (scheduler.waiting or scheduler.last_step.num_prefill_tokens):
            scheduler.step()
        decode = _record(scheduler, num_steps) if scheduler.has_unfinished() else None
    finally:
        for i in ids:
            scheduler.discard_request(i)
    model = scheduler.model
    peaks = {"read_gb_s": measure_bandwidth(model.device)[0] / 1e9, "matmul_gflop_s": matmul_rate(model) / 1e9}
    phases = (("prefill", prefill), ("decode", decode))
    return {
        "peaks": peaks,
        "dtype": weights_name(model),
        "phases": {name: breakdown(phase, model, peaks) for name, phase in phases if phase},
    }


def _record(scheduler: OnlineScheduler, num_steps: int) -> dict | None:
    steps, wall = [], 0.0
    sync = torch.cuda.synchronize if scheduler.model.device.type == "cuda" else None
    totals = step_timing.start_timing(sync)
    hooks = _time_modules(scheduler.model)
    graphs_before, whole_before = _graph_steps(scheduler), _whole_steps(scheduler)
    try:
        for _ in range(num_steps):
            if not scheduler.has_unfinished():
                break
            start = time.perf_counter()
            before = scheduler.num_steps
            scheduler.step()
            wall += time.perf_counter() - start
            if scheduler.num_steps > before:
                steps.append(asdict(scheduler.last_step))
    finally:
        step_timing.stop_timing()
        for hook in hooks:
            hook.remove()
    graph_steps, whole_steps = _graph_steps(scheduler) - graphs_before, _whole_steps(scheduler) - whole_before
    return {"times": dict(totals), "steps": steps, "wall": wall, "graph_steps": graph_steps,
            "whole_steps": whole_steps} if steps else None


def _graph_steps(scheduler: OnlineScheduler) -> int:
    """Steps replayed from CUDA graphs so far: a replay runs no Python, so it marks no parts."""
    compiled = scheduler.runner.compiled
    graphs = compiled.graphs if compiled is not None else None
    return graphs.num_steps if graphs is not None else 0


def _whole_steps(scheduler: OnlineScheduler) -> int:
    """Steps the compiled whole forward (--compile-model) served so far: its linears are inside its graph."""
    compiled = scheduler.runner.compiled
    step = compiled.step if compiled is not None else None
    return step.num_whole_steps if step is not None else 0


def _time_modules(model) -> list:
    """Time the model's linears and its LM head as parts, whatever modules they are (plain nn.Linear
    or a CPU fast path): a timer entered before each call and left after it."""
    hooks = []
    labelled = [(m, "linears") for m in weight_linears(model)] + [(model.lm_head, "LM head")]
    for module, label in labelled:
        timer = step_parts.part(label)
        hooks.append(module.register_forward_pre_hook(lambda m, args, t=timer: t.__enter__()))
        hooks.append(module.register_forward_hook(lambda m, args, out, t=timer: t.__exit__(None, None, None)))
    return hooks


def step_work(steps: list[dict], model) -> dict[str, tuple[float, float]]:
    """(bytes, FLOPs) each part must move and compute over these steps, from what they scheduled."""
    c = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    linears = weight_linears(model)
    linear_params = sum(m.in_features * m.out_features for m in linears)  # any architecture
    head_params = model.lm_head.in_features * c.vocab_size
    quantized = quantization_of(model) is not None  # then bytes as stored: int8/int4 weights and their scales
    linear_bytes = sum(map(module_bytes, linears)) if quantized else linear_params * elem
    head_bytes = module_bytes(model.lm_head) if quantized else head_params * elem
    token_kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * elem  # keys + values of one token, all layers
    work = defaultdict(lambda: [0.0, 0.0])
    for s in steps:
        tokens = s["num_decode_tokens"] + s["num_prefill_tokens"]
        work["linears"][0] += linear_bytes  # every weight read once a step
        work["linears"][1] += 2 * linear_params * tokens
        work["LM head"][0] += head_bytes
        work["LM head"][1] += 2 * head_params * s["num_sampled"]
        work["KV write"][0] += tokens * token_kv
        work["context read"][0] += s["cached_context_tokens"] * token_kv
        work["attention"][0] += s["cached_context_tokens"] * token_kv
        work["attention"][1] += 4 * c.num_layers * c.num_heads * c.head_dim * s["attended_pairs"]  # q.k and p.v
    return {k: tuple(v) for k, v in work.items()}


def breakdown(phase: dict, model, peaks: dict) -> dict:
    steps, n = phase["steps"], len(phase["steps"])
    times = dict(phase["times"])
    times[REST] = max(0.0, phase["wall"] - sum(times.values()))
    work = step_work(steps, model)
    rows = []
    for name in ROWS:
        if name in OPTIONAL_ROWS and name not in times:  # a feature that did not run marks no time: no row
            continue
        seconds = times.get(name, 0.0)
        nbytes, flops = work.get(name, (0.0, 0.0))
        floor = max(nbytes / (peaks["read_gb_s"] * 1e9), flops / (peaks["matmul_gflop_s"] * 1e9))
        bound = (
            ""
            if floor == 0
            else ("memory" if nbytes / peaks["read_gb_s"] > flops / peaks["matmul_gflop_s"] else "compute")
        )
        rows.append(
            {
                "part": name,
                "ms_per_step": 1e3 * seconds / n,
                "share": seconds / phase["wall"],
                "mb_per_step": nbytes / n / 1e6,
                "gflop_per_step": flops / n / 1e9,
                "gb_s": nbytes / seconds / 1e9 if seconds else 0.0,
                "gflop_s": flops / seconds / 1e9 if seconds else 0.0,
                "bound": bound,
                "of_floor": floor / seconds if seconds and floor else None,
            }
        )
    mean = lambda key: sum(s[key] for s in steps) / n
    return {
        "num_steps": n,
        "ms_per_step": 1e3 * phase["wall"] / n,
        "seqs": mean("num_seqs"),
        "decode_tokens": mean("num_decode_tokens"),
        "prefill_tokens": mean("num_prefill_tokens"),
        "context_tokens": mean("cached_context_tokens"),
        "graph_steps": phase.get("graph_steps", 0),
        "whole_steps": phase.get("whole_steps", 0),
        "rows": rows,
    }


def matmul_rate(model) -> float:
    """FLOP/s of a batch-sized matmul through the model's own largest linear (fast paths included)."""
    linear = max(weight_linears(model), key=lambda m: m.in_features * m.out_features)
    x = torch.randn(256, linear.in_features, dtype=model.dtype, device=model.device)
    with torch.inference_mode():
        seconds = best_time(lambda: linear(x), model.device)
    return 2 * x.shape[0] * linear.in_features * linear.out_features / seconds


def format_profile(p: dict) -> str:
    peaks = p["peaks"]
    lines = [
        f"{' Step-time breakdown (' + p['dtype'] + ') ':=^100}",
        f"machine: read bandwidth {peaks['read_gb_s']:.1f} GB/s (512 MiB, a part per thread), "
        f"matmul {peaks['matmul_gflop_s']:.0f} GFLOP/s (a 256-row linear); "
        "'of floor' = the part's floor time / its measured time",
    ]
    for name, ph in p["phases"].items():
        lines.append(
            f"-- {name}: {ph['num_steps']} steps of {ph['ms_per_step']:.1f} ms; per step "
            f"{ph['seqs']:.0f} seqs, {ph['decode_tokens']:.0f} decode + {ph['prefill_tokens']:.0f} prefill "
            f"tokens, {ph['context_tokens']:.0f} context tokens read from the KV cache"
        )
        if ph.get("graph_steps"):
            lines.append(
                f"   {ph['graph_steps']} of them replayed CUDA graphs: a replay marks no parts, so its model's whole "
                f"time (attention, linears, LM head) is in '{REST}'"
            )
        if ph.get("whole_steps"):
            lines.append(
                f"   {ph['whole_steps']} of them ran the whole forward compiled (--compile-model): its linears, LM "
                f"head and small ops run inside the graph, so their time is in '{REST}' (--no-compile-model "
                "splits them)"
            )
        lines.append(
            f"{'part':<{PART_WIDTH}}{'ms/step':>9}{'share':>8}{'MB/step':>10}{'GB/s':>8}{'GFLOP/step':>12}"
            f"{'GFLOP/s':>9}  {'bound':<8}{'of floor':>8}"
        )
        for r in ph["rows"]:
            of_floor = "" if r["of_floor"] is None else f"{r['of_floor']:.0%}"
            lines.append(
                f"{r['part']:<{PART_WIDTH}}{r['ms_per_step']:>9.2f}{r['share']:>8.1%}{r['mb_per_step']:>10.1f}"
                f"{r['gb_s']:>8.1f}{r['gflop_per_step']:>12.2f}{r['gflop_s']:>9.1f}  {r['bound']:<8}"
                f"{of_floor:>8}"
            )
    lines.append("=" * 100)
    return "\n".join(lines)
