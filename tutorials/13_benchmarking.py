"""Stage 13: benchmarking: TTFT, TPOT, ITL, end-to-end latency and throughput, and reading a trace.

Runs `python bench.py` on a tiny workload (6 requests, all arriving at once,
at most 4 running together) with --json and --trace, then recomputes every
latency metric of the summary from the per-request records, using vLLM's
definitions, and checks them against bench.py's. Finally it reads the
Chrome/Perfetto trace: per-request spans (queued, prefill, decode) and per-step
engine counters, drawn here as text, the same picture ui.perfetto.dev shows.
bench.py's --roofline adds the batch-1 decode floor (weight bytes / memory
bandwidth), whose weight bytes are recomputed here from the config.

    python tutorials/13_benchmarking.py   # MINFER_MODEL=/path to choose the checkpoint
"""

import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import model_path, section

from minfer.models.config import GPT2Config

path = model_path()
BENCH = Path(__file__).resolve().parent.parent / "bench.py"
MAX_SEQS = 4

section("run bench.py")
with tempfile.TemporaryDirectory() as tmp:
    report_file, trace_file = Path(tmp) / "report.json", Path(tmp) / "run.trace.json"
    cmd = [
        sys.executable,
        str(BENCH),
        "--model",
        path,
        "--num-requests",
        "6",
        "--input-len",
        "8:24",
        "--output-len",
        "4:12",
        "--max-num-seqs",
        str(MAX_SEQS),
        "--json",
        str(report_file),
        "--trace",
        str(trace_file),
        "--roofline",
        "--profile",
        "--disable-tqdm",
    ]
    print("$ python bench.py " + " ".join(cmd[2:]))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stderr
    report = json.loads(report_file.read_text())
    trace = json.loads(trace_file.read_text())

summary, records = report["summary"], report["requests"]
print(f"the JSON holds: {sorted(report)}; {len(records)} request records like")
print(f"  {json.dumps({k: v for k, v in records[0].items() if k != 'itl'})[:300]}")

section("recompute the summary from the per-request records (vLLM's definitions)")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics, as numpy.percentile does by default."""
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# All times in a record are seconds since the run started.
ttft = [r["first_token_time"] - r["submit_time"] for r in records]  # queueing + prefill + first sample
e2el = [r["finish_time"] - r["submit_time"] for r in records]  # the whole request
tpot = [
    (e - t) / (r["output_len"] - 1)  # mean gap after the first token, per request
    for r, t, e in zip(records, ttft, e2el)
    if r["output_len"] > 1
]
itl = [gap for r in records for gap in r["itl"]]  # every gap between consecutive tokens, pooled
mine = {"ttft": ttft, "tpot": tpot, "itl": itl, "e2el": e2el}
print(f"{'metric (ms)':<12}{'mean':>9}{'median':>9}{'p90':>9}{'p99':>9}   (ours; bench.py's must match)")
for name, values in mine.items():
    stats = {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }
    print(f"{name.upper():<12}" + "".join(f"{1e3 * v:9.2f}" for v in stats.values()))
    for stat, v in stats.items():
        assert math.isclose(1e3 * v, summary[f"{stat}_{name}_ms"], rel_tol=1e-9), (name, stat)
out_tokens = sum(r["output_len"] for r in records)
in_tokens = sum(r["input_len"] for r in records)
assert out_tokens == summary["total_output_tokens"] and in_tokens == summary["total_input_tokens"]
assert all(r["output_len"] == r["expected_output_len"] for r in records), "ignore_eos: exact output lengths"
assert all(len(r["itl"]) == r["output_len"] - 1 for r in records), "offline: one gap per token after the first"
for name, value in [
    ("request_throughput", len(records) / summary["duration"]),
    ("output_throughput", out_tokens / summary["duration"]),
    ("total_token_throughput", (in_tokens + out_tokens) / summary["duration"]),
]:
    assert math.isclose(value, summary[name], rel_tol=1e-9), name
print(
    f"throughput: {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s "
    f"over {summary['duration']:.3f} s (first submit to last completion)"
)
# The two requests beyond max_num_seqs waited for a slot: their TTFT includes that queueing.
queued_ms = [1e3 * (r["scheduled_time"] - r["submit_time"]) for r in records]
print("time queued before the first step (ms):", [round(q, 1) for q in queued_ms])

section("read the trace: what ui.perfetto.dev would draw")
events = trace["traceEvents"]
spans = [e for e in events if e["ph"] == "X"]  # complete events: name, ts and dur in microseconds
names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
steps = sorted((e for e in spans if e["name"] == "step"), key=lambda e: e["ts"])
by_request: dict[tuple, dict[str, dict]] = {}  # (pid, tid) of a request's track -> its spans by name
for e in spans:
    if e["name"] != "step":
        by_request.setdefault((e["pid"], e["tid"]), {})[e["name"]] = e
print(
    f"{len(events)} events: {len(steps)} engine steps, {len(by_request)} request tracks "
    f"({sorted({e['name'] for e in spans})} spans), counters {sorted({e['name'] for e in events if e['ph'] == 'C'})}"
)
for s in by_request.values():
    assert list(s) == ["queued", "prefill", "decode"], s.keys()
    # queued -> prefill -> decode, end to end (times are rounded to 1 ns)
    assert math.isclose(s["queued"]["ts"] + s["queued"]["dur"], s["prefill"]["ts"], abs_tol=0.01)
    assert math.isclose(s["prefill"]["ts"] + s["prefill"]["dur"], s["decode"]["ts"], abs_tol=0.01)


def state(s: dict[str, dict], t: float) -> str:
    """What a request was doing at time t (us): queued, prefill, decode, or not around."""
    for name, mark in (("queued", "."), ("prefill", "P"), ("decode", "D")):
        if s[name]["ts"] <= t < s[name]["ts"] + s[name]["dur"]:
            return mark
    return " "


print("one column per engine step: . queued  P prefill  D decode   (below: sequences in the step's batch)")
for track in sorted(by_request):
    row = "".join(state(by_request[track], step["ts"] + step["dur"] / 2) for step in steps)
    print(f"  {names[track]:<10} |{row}|")
print(f"  {'batch':<10} |{''.join(str(step['args']['num_seqs']) for step in steps)}|")
print(f"first step: {steps[0]['args']}")
print(f"last step:  {steps[-1]['args']}")

batch = [step["args"]["num_seqs"] for step in steps]
assert max(batch) == MAX_SEQS and all(n <= MAX_SEQS for n in batch)
# Continuous batching: some request started its prefill while another was in the middle of decoding,
# and the batch shrank as requests finished at different lengths.
joins = [
    a
    for a, sa in by_request.items()
    for b, sb in by_request.items()
    if sb["decode"]["ts"] < sa["prefill"]["ts"] < sb["decode"]["ts"] + sb["decode"]["dur"]
]
assert joins, "a request joined a batch that was already decoding"
assert batch[-1] < max(batch)
# Every output token but each request's first came from a decode step; every prompt token not
# served by the prefix cache went through a prefill step.
assert summary["num_preemptions"] == 0
assert sum(step["args"]["num_decode_tokens"] for step in steps) == out_tokens - len(records)
assert sum(step["args"]["num_prefill_tokens"] for step in steps) == in_tokens - summary["prefix_cache_hit_tokens"]

section("the decode floor (--roofline): a decode step reads every weight once")
cfg = GPT2Config.from_json(path)
C, V, L = cfg.n_embd, cfg.vocab_size, cfg.n_layer
per_layer = (2 * C) * 2 + (C * 3 * C + 3 * C) + (C * C + C) + (C * cfg.mlp_dim + cfg.mlp_dim) + (cfg.mlp_dim * C + C)
params = V * C + cfg.n_positions * C + L * per_layer + 2 * C  # embeddings (the LM head reuses wte), blocks, ln_f
roof = report["roofline"]
print(f"{params:,} parameters x 4 bytes = {4 * params / 1e6:.1f} MB per decode step at batch 1")
print(
    f"read bandwidth {roof['bandwidth_gb_s']:.1f} GB/s -> floor {roof['floor_tpot_ms']:.3f} ms per token; "
    f"measured batch-1 TPOT {roof['measured_tpot_ms']:.2f} ms ({roof['measured_over_floor']:.1f}x the floor)"
)
assert roof["weight_bytes"] == 4 * params and roof["dtype"] == "float32"
assert math.isclose(roof["floor_tpot_ms"], 1e3 * roof["weight_bytes"] / (1e9 * roof["bandwidth_gb_s"]), rel_tol=1e-9)
# On the tiny checkpoint the weights fit in the CPU's cache and per-step Python work dominates, so the
# ratio is large; on gpt2 (497 MB) the weights are the main cost and the ratio is what to optimise.
section("where a step's time goes (--profile)")
phases = report["profile"]["phases"]
decode = {row["part"]: row for row in phases["decode"]["rows"]}
print(f"a steady decode step of {phases['decode']['seqs']:.0f} sequences: {phases['decode']['ms_per_step']:.2f} ms")
for name, row in sorted(decode.items(), key=lambda item: -item[1]["ms_per_step"])[:5]:
    print(f"  {name:<24} {row['ms_per_step']:6.2f} ms  {row['share']:6.1%}")
# The parts cover the step once each: their shares add up to the whole step.
assert abs(sum(row["share"] for row in decode.values()) - 1) < 0.02
# The linears' bytes are the block weights, read once per step whatever the batch: 12 C^2 per layer.
assert math.isclose(decode["linears"]["mb_per_step"], L * 12 * C * C * 4 / 1e6, rel_tol=1e-9)
# And the LM head reads the (tied) V x C embedding once, for the sampling rows only.
assert math.isclose(decode["LM head"]["mb_per_step"], V * C * 4 / 1e6, rel_tol=1e-9)
print("(on gpt2 the linears and LM head dominate a small batch; context read and attention grow with it)")

print("\nopen the trace yourself: python bench.py ... --trace run.trace.json, then ui.perfetto.dev -> Open trace file")
print("\nOK: the summary recomputed from the records, and a trace showing requests joining and leaving the batch.")
