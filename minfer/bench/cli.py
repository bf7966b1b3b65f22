"""Benchmark minfer: TTFT, TPOT, ITL, end-to-end latency, throughput and peak memory.

Offline mode drives the engine in-process; online mode starts `python -m minfer.serve`
(or targets any OpenAI-compatible server with --base-url) and streams completions
from client threads. Metric definitions follow vLLM's benchmark (minfer/bench/metrics.py).

    python -m minfer.random_model /tmp/gpt2-random --config gpt2      # no Hub? a random GPT-2
    python bench.py --model /tmp/gpt2-random --num-requests 64 --input-len 128 --output-len 128
    python bench.py --model /tmp/gpt2-random --input-len 32:256 --output-len 16:256 --baseline hf
    python bench.py --model /tmp/gpt2-random --mode online --request-rate 4 --trace run.trace.json
    python bench.py --model /tmp/gpt2-random --roofline --num-requests 1 --output-len 64
    python bench.py --base-url http://localhost:8000 --model gpt2 --tokenizer /tmp/gpt2-random  # e.g. vLLM
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from ..cpu.features import cpu_name
from ..cpu.threads import cpu_threads_wanted, threads_chosen
from ..engine.config import EngineConfig
from ..errors import BadSetting
from ..assembly.build import resolve_dtype, set_cpu_threads
from ..assembly.llm import LLM
from ..engine.scheduler import OnlineScheduler
from ..models.loader import BUILTIN_MODELS, ModelNotFoundError, resolve_model_dir
from ..models.registry import read_config
from ..cpu.openmp import wait_policy
from ..text.tokenizer import Tokenizer
from .flags import parse_args
from .hf_baseline import compare, format_comparison, generate_batch, load_hf_model, run_hf
from .metrics import RunResult, cut_short_line, format_summary, median_summary, summarize
from .offline import run_offline
from .online import Endpoint, EngineFeedReader, ServerProcess, failures_line, refuse_if_all_failed, run_online
from .profile import format_profile, profile_steps
from .report import format_header, format_masks, memory_owner, progress, result_title
from .roofline import format_roofline, roofline
from .speculation import counters_of_server, counters_of_stats, format_spec, spec_summary
from .trace import write_trace
from .workload import STRUCTURED_OUTPUTS, build_workload, copy_texts, read_prompts, warmup_workload

NO_MODEL_HINT = (
    "{prog}: error: cannot load model {model!r} ({why}). Pass a local checkpoint with --model DIR; "
    "write a random GPT-2-sized one with: python -m minfer.random_model DIR --config gpt2"
)


def find_model_dir(args) -> Path | None:
    """The local checkpoint: always needed, except by --base-url with a served model name."""
    if args.base_url:
        tokenizer = args.tokenizer
        if tokenizer and tokenizer not in BUILTIN_MODELS and not Path(tokenizer).expanduser().is_dir():
            raise BadSetting(f"--tokenizer {tokenizer!r} is not a directory")  # not passed over for --model's
        for candidate in (tokenizer, args.model):
            if candidate in BUILTIN_MODELS:  # a served minfer-tiny: its shipped directory has the tokenizer
                return BUILTIN_MODELS[candidate]
            if candidate and Path(candidate).expanduser().is_dir():
                return Path(candidate).expanduser()
        return None
    try:
        return resolve_model_dir(args.model)
    except FileNotFoundError as e:  # a mistyped path: the same advice as for an unreachable Hub id
        raise ModelNotFoundError(str(e)) from None


def set_threads(args) -> None:
    """Every core, as LLM does, unless --num-threads: minfer and the hf baseline get the same."""
    if torch.device(args.device).type == "cpu":
        set_cpu_threads(args.num_threads)


def peak_memory(device: torch.device) -> dict:
    """This process's high-water RSS, and on a GPU the CUDA peak since the last reset."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"peak_rss_mib": rss / (2**20 if sys.platform == "darwin" else 1024)}
    if device.type == "cuda":
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def machine(device: str) -> str:
    """What ran the benchmark, for the JSON: the GPU's name, else the CPU model."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def run_summary(result: RunResult, **extra) -> dict:
    done = [r for r in result.records if r.success]
    extra["num_preemptions"] = sum(r.num_preemptions or 0 for r in done)
    extra["prefix_cache_hit_tokens"] = sum(r.num_cached_tokens or 0 for r in done)
    return summarize(result.records, result.duration, **extra)


def offline_runs(args, engine, model_dir, workloads, warm) -> tuple[list[RunResult], list[dict], OnlineScheduler]:
    progress(f"loading {model_dir} ...")
    llm = LLM(str(model_dir), config=engine)
    ran = llm.scheduler.engine_config
    progress(f"loaded: {ran.dtype}, attention {ran.attention_backend}, {ran.num_kv_blocks} KV blocks")
    device = llm.model.device
    if args.warmup_runs:
        progress(f"warming up ({args.warmup_runs} small unmeasured run{'s' if args.warmup_runs > 1 else ''}) ...")
    for _ in range(args.warmup_runs):
        run_offline(llm.scheduler, warm, progress=False, defaults=llm.sampling_defaults)
    results, summaries = [], []
    for k, workload in enumerate(workloads):
        progress(f"measuring run {k + 1} of {len(workloads)} ...")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        bar = not args.disable_tqdm
        before = counters_of_stats(llm.scheduler.stats())
        results.append(run_offline(llm.scheduler, workload, args.max_concurrency, bar, f"run {k}", args.n,
                                   llm.sampling_defaults))
        spec = spec_summary(before, counters_of_stats(llm.scheduler.stats()))
        summaries.append(run_summary(results[-1], **peak_memory(device), **spec))
    return results, summaries, llm.scheduler


def online_runs(args, engine, model_dir, workloads, warm, tokenizer) -> tuple[list[RunResult], list[dict]]:
    results, summaries = [], []
    count_tokens = (lambda text: len(tokenizer.encode(text))) if tokenizer else None  # a server with no usage

    def measure(endpoint: Endpoint, server: ServerProcess | None = None) -> None:
        model = endpoint.served_model(args.model)
        if args.warmup_runs:
            progress("warming up ...")
        for _ in range(args.warmup_runs):
            refuse_if_all_failed(run_online(endpoint, model, warm, progress=False), endpoint)
        for k, workload in enumerate(workloads):
            progress(f"measuring run {k + 1} of {len(workloads)} ...")
            # Watching the engine costs the server a little: only for the run that is traced.
            before = counters_of_server(endpoint)
            with EngineFeedReader(endpoint) if args.trace and k == len(workloads) - 1 else nullcontext() as feed:
                bar = not args.disable_tqdm
                results.append(
                    run_online(endpoint, model, workload, args.max_concurrency, bar, f"run {k}", feed, args.n,
                               count_tokens)
                )
            refuse_if_all_failed(results[-1], endpoint)
            if failed := failures_line(results[-1]):  # the table counts them; here is why (--json: each one's)
                print(f"bench.py: {failed}", file=sys.stderr)
            memory = {"peak_rss_mib": server.peak_rss_mib()} if server else {}  # the server's, not ours
            spec = spec_summary(before, counters_of_server(endpoint))
            summaries.append(run_summary(results[-1], **memory, **spec))

    if args.base_url:
        measure(Endpoint(args.base_url))
        return results, summaries
    flags = engine.to_cli_args()
    if args.num_requests > 128:  # or the excess gets 429
        flags += ["--max-queued", str(args.num_requests)]
    progress(f"starting python -m minfer.serve on {model_dir} ...")
    with ServerProcess(model_dir, flags + shlex.split(args.server_args)) as server:
        measure(server.endpoint, server)
    return results, summaries


def baseline_hf(args, model_dir, tokenizer: Tokenizer, workload, minfer_summary: dict, dtype: torch.dtype) -> dict:
    """The first run's workload (its first --hf-num-requests) through transformers' generate, with the same
    threads and dtype."""
    set_threads(args)
    workload = workload[: args.hf_num_requests]
    progress("loading the checkpoint into transformers for the baseline ...")
    model = load_hf_model(model_dir, args.device, dtype, progress=not args.disable_tqdm)
    prompts = [r.prompt_token_ids or tokenizer.encode_prompt(r.prompt) for r in workload]  # tokenized up front
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    if args.warmup_runs:
        generate_batch(model, prompts[:2], 4, pad)
    device = model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = run_hf(model, prompts, [r.output_len for r in workload], args.hf_batch_size, pad, not args.disable_tqdm)
    # Peak RSS is the whole process's and minfer ran in it first; only a GPU's peak can be reset.
    memory = {"peak_cuda_mib": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else {}
    summary = summarize(result.records, result.duration, **memory)
    ratios = compare(minfer_summary, summary)
    records = [r.to_json() for r in result.records]
    return {
        "name": "hf",
        "batch_size": args.hf_batch_size,
        "num_requests": len(workload),
        "summary": summary,
        "minfer_over_hf": ratios,
        "requests": records,
    }


def print_runs(summaries: list[dict]) -> None:
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
    for k, s in enumerate(summaries):
        print(
            f"run {k}: {s['duration']:.2f} s, {s['output_throughput']:.1f} output tok/s, "
            f"mean TTFT {fmt(s['mean_ttft_ms'], '.1f')} ms, mean TPOT {fmt(s['mean_tpot_ms'], '.2f')} ms"
        )


def header(args, engine: EngineConfig) -> str:
    """The configuration as this run will use it, printed before anything loads."""
    cpu = torch.device(args.device).type == "cpu"
    if args.base_url:  # another machine, perhaps: what runs there is not known here
        device, dtype, threads, attention = "the server's", "the server's", "the server's", "the server's"
    else:
        device = f"{args.device} ({machine(args.device)})"
        dtype = str(resolve_dtype(args.dtype, torch.device(args.device))).removeprefix("torch.")
        dtype = f"{dtype} (--dtype {args.dtype})" if args.dtype == "auto" else dtype
        adapts = "" if threads_chosen(engine.num_threads) else " (fewer while other processes use these cores)"
        threads = f"{cpu_threads_wanted(engine.num_threads)}{adapts}; {wait_policy()}" if cpu else "n/a (GPU)"
        attention = "eager (--enforce-eager)" if engine.enforce_eager else engine.attention_backend
    return format_header(args, device, dtype, threads, attention)


def run(args) -> int:
    engine = EngineConfig.from_cli_args(args)  # parse_args has judged the flags
    model_dir = find_model_dir(args)
    if (args.baseline or args.roofline or args.profile) and model_dir is None:
        raise ValueError(
            "--baseline, --roofline and --profile load the checkpoint here: pass its directory as --tokenizer"
        )
    tokenizer = Tokenizer.from_dir(model_dir) if model_dir else None
    config = read_config(model_dir) if model_dir else None
    vocab, context = (config.vocab_size, config.max_positions) if config else (None, None)
    shorter = not args.base_url and engine.max_model_len and context and engine.max_model_len < context
    context = engine.max_model_len if shorter else context  # what the engine bench runs will take
    try:
        texts = read_prompts(args.prompt, args.prompts_file)
    except (OSError, ValueError) as e:  # --prompt or --prompts-file: a bad flag
        raise BadSetting(str(e)) from None
    if args.workload == "copy":
        if model_dir is None:
            raise ValueError("--workload copy reads the model's heldout.txt: pass its directory as --tokenizer")
        texts += copy_texts(model_dir, args.num_requests)
    workloads = [
        build_workload(
            args.num_requests,
            args.input_len,
            args.output_len,
            texts=texts,
            tokenizer=tokenizer,
            vocab_size=vocab,
            context=context,
            context_set_by="--max-model-len" if shorter else None,
            rate=args.request_rate,
            seed=args.seed,
            pretok=args.pretok,
            run=k,
        )
        for k in range(args.repeat_runs)
    ]
    for request in (r for workload in workloads for r in workload):
        request.logprobs = args.logprobs
    warm = warmup_workload(workloads[0], tokenizer, vocab)
    for request in (r for workload in [*workloads, warm] for r in workload):  # the warm-up compiles the grammar
        request.structured_outputs = STRUCTURED_OUTPUTS.get(args.structured_output)
    print(header(args, engine))
    if args.mode == "offline":
        results, summaries, scheduler = offline_runs(args, engine, model_dir, workloads, warm)
    else:
        (results, summaries), scheduler = online_runs(args, engine, model_dir, workloads, warm, tokenizer), None

    for short in filter(None, (cut_short_line(result.records) for result in results)):
        print(f"bench.py: {short}", file=sys.stderr)
    summary = median_summary(summaries)
    if len(summaries) > 1:
        print_runs(summaries)
    print(format_summary(summary, result_title(args.mode, len(summaries)), memory_owner(args.mode, args.base_url)))
    speculation = format_spec(summary)
    if speculation:
        print(speculation)
    masks = scheduler.features.structured.stats if args.structured_output and scheduler else None
    if masks:
        print(format_masks(masks))
    # The dtype minfer ran in ("auto" resolves per machine); the baseline uses the same.
    dtype = scheduler.model.dtype if scheduler else resolve_dtype(args.dtype, torch.device(args.device))
    settings = {
        **vars(args),
        "request_rate": str(args.request_rate),
        "model_dir": model_dir and str(model_dir),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        # by CpuShare, under load
        "thread_count_changes": threads.changes if (threads := scheduler and scheduler.features.threads) else None,
        "machine": None if args.base_url else machine(args.device),  # the server's is not known here
    }
    records = [dict(r.to_json(), run=k) for k, res in enumerate(results) for r in res.records]
    report = {"config": settings, "summary": summary, "runs": summaries, "requests": records}
    if masks:
        report["structured_masks"] = masks
    if args.baseline:
        report["baseline"] = base = baseline_hf(args, model_dir, tokenizer, workloads[0], summaries[0], dtype)
        subset = "" if base["num_requests"] == len(workloads[0]) else f", its first {base['num_requests']} requests"
        print(format_summary(base["summary"], f"transformers generate, batch {args.hf_batch_size}{subset}"))
        print(format_comparison(summaries[0], base["summary"], args.hf_batch_size))
    if (args.roofline or args.profile) and scheduler is None:  # online: the server is gone; load minfer here
        scheduler = LLM(str(model_dir), config=engine).scheduler
    if args.roofline:
        report["roofline"] = roofline(scheduler, output_len=64, seed=args.seed)
        print(format_roofline(report["roofline"]))
    if args.profile:
        report["profile"] = profile_steps(scheduler, workloads[0])
        print(format_profile(report["profile"]))
    if args.trace:
        write_trace(args.trace, results[-1].records, results[-1].steps, {"mode": args.mode, "model": args.model})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    return 0


def main(argv: list[str] | None = None, prog: str = "python bench.py") -> int:
    args = parse_args(argv, prog)
    try:
        return run(args)
    except ModelNotFoundError as e:
        print(NO_MODEL_HINT.format(prog=prog, model=args.model, why=str(e).split(" (")[0]), file=sys.stderr)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as minfer generate does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # or the exit's flush fails once more
    except BadSetting as e:  # a flag this model or run cannot take: argparse's status for a bad flag
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError) as e:  # files or servers: one line, no traceback
        print(f"{prog}: error: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
