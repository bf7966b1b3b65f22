"""bench.py's command line: its flags, and the checks that refuse a bad value or a flag the run would not
apply (one argparse error, exit 2) before anything loads. The engine's own flags come from EngineConfig."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..engine.config import EngineConfig
from ..scoring.logprobs import MAX_LOGPROBS
from .online import Endpoint
from .report import DefaultsOnce
from .workload import STRUCTURED_OUTPUTS, parse_length

DESCRIPTION = "Benchmark minfer: TTFT, TPOT, ITL, end-to-end latency, throughput and peak memory."


def parse_args(argv: list[str] | None, prog: str = "python bench.py") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=DefaultsOnce)
    p.add_argument("--mode", choices=["offline", "online"], default="offline",
                   help="offline: minfer in-process; online: HTTP to minfer.serve (or to --base-url)")
    p.add_argument("--model", default="gpt2", help="checkpoint dir or Hub id (--base-url: the served name)")
    p.add_argument("--tokenizer", help="with --base-url: a checkpoint directory, for random prompts")
    p.add_argument("--base-url", help="measure this OpenAI-compatible server instead of starting minfer.serve")
    p.add_argument("--server-args", default="", help="extra flags for minfer.serve: --server-args='--max-queued 512'")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument("--input-len", default="128", help="prompt tokens: N, or A:B drawn uniformly per request")
    w.add_argument("--output-len", default="128", help="generated tokens, exactly (ignore_eos): N or A:B")
    w.add_argument("--prompt", action="append",
                   help="a text prompt instead of random tokens (repeatable; then no --input-len)")
    w.add_argument("--prompts-file", help="text prompts, one per line, used in turn")
    w.add_argument(
        "--workload",
        choices=["random", "copy"],
        default="random",
        help="random: random token prompts (or --prompt/--prompts-file); copy: held-out stories, then the "
        "first one's opening again (the model's heldout.txt; where speculative decoding pays)",
    )
    w.add_argument("--pretok", action="store_true", help="tokenize text prompts outside the timed region")
    w.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    w.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    w.add_argument("--logprobs", type=int, help="every request asks for each token's logprob and the k likeliest")
    w.add_argument("--n", type=int, default=1, help="completions per prompt (n > 1: seeded sampling, shared blocks)")
    w.add_argument(
        "--structured-output",
        choices=sorted(STRUCTURED_OUTPUTS),
        help="every request's output held to a JSON schema (an array of records that never ends before the "
        "output length): what the token masks cost; offline, their time per masked row is reported",
    )
    w.add_argument("--seed", type=int, default=0, help="seeds the workload's draws, and the engine (--seed of serve)")
    r = p.add_argument_group("runs and output")
    r.add_argument("--warmup-runs", type=int, default=1, help="small unmeasured workloads run first")
    r.add_argument("--repeat-runs", type=int, default=1, help="measured runs; the summary is their median")
    r.add_argument("--json", help="write config, summary, per-request records (and baseline, roofline) here")
    r.add_argument("--trace", help="write a Chrome/Perfetto trace of the last run here (ui.perfetto.dev)")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    e = p.add_argument_group("engine (offline: in this process; online: passed to minfer.serve)")
    EngineConfig.add_cli_arguments(e, exclude=("model", "seed"))  # both defined above
    x = p.add_argument_group("comparisons")
    x.add_argument("--baseline", choices=["hf"], help="also run the workload through transformers' generate")
    x.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf baseline")
    x.add_argument("--hf-num-requests", type=int, help="the baseline runs only the workload's first N requests (a "
                   "slow baseline on a big workload; throughputs compare, latencies less so) (default: all)")
    x.add_argument("--roofline", action="store_true", help="batch-1 TPOT beside the weights/bandwidth floor")
    x.add_argument("--profile", action="store_true", help="split prefill and decode steps into parts (KV write, "
                   "context read, attention, linears, LM head, sampling, host), each with its bytes, FLOPs and bound")
    args = p.parse_args(argv)
    if args.base_url:
        args.mode = "online"
        try:  # a URL that names no server: refused before anything loads
            Endpoint(args.base_url)
        except ValueError as e:
            p.error(str(e))
    for name in ("repeat_runs", "max_concurrency", "hf_batch_size", "hf_num_requests", "num_requests", "n"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_runs < 0:
        p.error("--warmup-runs must be >= 0")
    for name in ("input_len", "output_len"):
        try:
            parse_length(getattr(args, name), f"--{name.replace('_', '-')}")
        except ValueError as e:
            p.error(str(e))
    if not args.request_rate > 0:  # nan too
        p.error(f"--request-rate must be > 0 (or inf), got {args.request_rate:g}")
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        p.error(f"--logprobs must be from 0 to {MAX_LOGPROBS}")
    starts_server = args.mode == "online" and not args.base_url
    texts = args.prompt or args.prompts_file or args.workload == "copy"  # else random token prompts
    for flag, given, applies, where in (  # a flag this run would not apply is a mistake, not a no-op
            ("--tokenizer", args.tokenizer, args.base_url, "with --base-url"),
            ("--server-args", args.server_args, starts_server, "when bench starts a server (--mode online)"),
            ("--hf-batch-size", args.hf_batch_size != p.get_default("hf_batch_size"), args.baseline, "with --baseline"),
            ("--hf-num-requests", args.hf_num_requests, args.baseline, "with --baseline"),
            ("--input-len", args.input_len != p.get_default("input_len"), not texts,
             "to random prompts (not --prompt, --prompts-file, --workload copy: their lengths are the texts')"),
            ("--pretok", args.pretok, texts, "to text prompts (--prompt, --prompts-file, --workload copy)")):
        if given and not applies:
            p.error(f"{flag} applies only {where}")
    for flag, path in (("--json", args.json), ("--trace", args.trace)):  # written last: refused before the run
        if path and Path(path).is_dir():
            p.error(f"{flag} {path}: a directory, not a file")
        if path and not Path(path).expanduser().absolute().parent.is_dir():
            p.error(f"{flag} {path}: no directory {Path(path).expanduser().absolute().parent}")
    if args.baseline and args.n > 1:
        p.error("--baseline runs transformers' generate once per prompt: compare with --n 1")
    try:  # the engine's flags, judged before anything loads: one line, with argparse's status for a bad flag
        engine = EngineConfig.from_cli_args(args)
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    given = [f for f in engine.to_cli_args(exclude=("model", "seed")) if f.startswith("--")]
    if args.base_url and given and not (args.baseline or args.roofline or args.profile):  # these load it here
        p.error(f"{given[0]} applies only to an engine bench runs (offline, or the minfer.serve it starts); "
                "a --base-url server keeps its own settings")
    return args
