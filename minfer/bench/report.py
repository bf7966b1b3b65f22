"""What bench.py prints around its figures: a header that echoes what is measured, progress
lines while it loads and warms up, and titles that say which mode ran and whose memory is shown; and its
--help, each flag with its default once."""

from __future__ import annotations

import argparse
import sys
import time

_START = time.perf_counter()


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default, once: not "(default: 64) (default: None)" after a help that says it in words."""

    def _get_help_string(self, action):
        said = "default:" in (action.help or "") or "(default" in (action.help or "")
        return action.help if said else super()._get_help_string(action)


def progress(message: str) -> None:
    """One line on stderr from the first second on, so a long load is never silent."""
    print(f"bench.py [{time.perf_counter() - _START:5.1f}s] {message}", file=sys.stderr, flush=True)


def _lengths(spec: str) -> str:
    return spec.replace(":", "-")


def format_header(args, device: str, dtype: str, threads: str, attention: str) -> str:
    """The configuration, echoed before anything runs: the figures below mean nothing without it."""
    target = f"{args.base_url} (served name {args.model!r})" if args.base_url else args.model
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s (Poisson)"
    concurrency = f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""
    prompts = f"{_lengths(args.input_len)} random tokens"
    if args.workload == "copy":
        prompts = "held-out stories (copy)"
    elif args.prompt or args.prompts_file:
        prompts = "text prompts"
    rows = [
        ("model", target),
        ("mode", "online: HTTP streams to a server" if args.mode == "online"
         else "offline: the engine in this process"),
        ("device", device),
        ("dtype", dtype),
        ("threads", threads),
        ("attention", attention),
        ("workload", f"{args.num_requests} requests: {prompts} in, {_lengths(args.output_len)} tokens out"
                     + (f", held to a {args.structured_output} (token masks)" if args.structured_output else "")),
        ("arrivals", rate + concurrency),
        ("runs", f"{args.warmup_runs} warm-up, {args.repeat_runs} measured"),
    ]
    return "\n".join([f"{' minfer bench ':=^50}", *(f"{k + ':':<11}{v}" for k, v in rows), "=" * 50])


def format_masks(stats: dict) -> str:
    """What the structured-output masks cost, per masked row (a row: one token of a constrained request), over
    the warm-up and the measured runs."""
    return (
        f"Structured outputs: {stats['rows']} masked rows in {stats['steps']} steps; per row, llguidance's fill "
        f"{stats['fill_us_per_row']:.1f} us on the mask thread (during the forward), of which the step waited "
        f"{stats['wait_us_per_row']:.1f} us, and applying it {stats['apply_us_per_row']:.1f} us"
    )


def result_title(mode: str, runs: int) -> str:
    title = "Serving Benchmark Result (online)" if mode == "online" else "Offline Benchmark Result"
    return title + (f" (median of {runs} runs)" if runs > 1 else "")


def memory_owner(mode: str, base_url: str | None) -> str | None:
    """Whose peak RSS the summary shows: the engine's process, whichever that is."""
    if base_url:
        return None  # another server's memory is not ours to read
    return "the minfer server process" if mode == "online" else "this process, the engine in it"
