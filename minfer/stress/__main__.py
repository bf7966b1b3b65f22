"""Command line of the soak: see minfer/stress/__init__.py."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from urllib.parse import urlsplit

from . import __doc__ as DOC
from .clients import Tally, Target
from .soak import ServerDidNotStart, SoakConfig, run_spawned, soak


def say(line: str) -> None:
    """Progress while the soak runs: on stderr, so stdout holds only the figures."""
    print(f"minfer.stress: {line}", file=sys.stderr, flush=True)


def server_address(base_url: str) -> tuple[str, int]:
    """--base-url's host and port. The soak speaks plain HTTP to the server's own paths (/v1/completions,
    /health): a URL asking for TLS or a path before /v1 is refused, not dropped."""
    url = urlsplit(base_url if "://" in base_url else "http://" + base_url)
    try:
        port = url.port or 80
    except ValueError:  # no number, or past 65535
        port = None
    if url.scheme != "http" or not url.hostname or port is None or url.path.rstrip("/") not in ("", "/v1"):
        raise ValueError("--base-url must look like http://HOST:PORT (the soak speaks plain HTTP to the server's "
                         f"own paths), got {base_url!r}")
    return url.hostname, port


def main(argv: list[str] | None = None, prog: str = "python -m minfer.stress") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DOC.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--model", help="checkpoint directory or name: start a server on it (and SIGTERM it at the "
                       "end); without --model or --base-url, minfer-tiny, the small model minfer ships")
    where.add_argument("--base-url", help="an already running server, e.g. http://127.0.0.1:8000")
    d = SoakConfig()
    parser.add_argument("--duration", type=float, default=d.duration, help="seconds of load")
    parser.add_argument("--streams", type=int, default=d.streams, help="concurrent streaming clients")
    parser.add_argument("--kv-blocks", type=int, default=48, help="with --model: the server's --num-kv-blocks")
    parser.add_argument("--request-timeout", type=float, default=30.0, help="with --base-url: the server's")
    parser.add_argument("--keepalive-timeout", type=float, default=15.0, help="with --base-url: the server's")
    parser.add_argument("--write-timeout", type=float, default=30.0, help="with --base-url: the server's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--float64-server", action="store_true", help="with --base-url: the server runs --dtype "
                        "float64, so a seeded stream replayed alone must match exactly (else differences are "
                        "counted, not failed: in fp32 or bf16 rounding changes about one sampled token in 6,000)")
    parser.add_argument("--json", help="also write the figures and failures to this file")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.streams < 1:
        parser.error("--duration must be > 0 and --streams >= 1")
    server_flags = ("request_timeout", "keepalive_timeout", "write_timeout", "float64_server")
    given = ["--" + f.replace("_", "-") for f in server_flags if getattr(args, f) != parser.get_default(f)]
    if given and not args.base_url:  # they describe someone else's server; ours is started with its own
        parser.error(f"{given[0]} applies only with --base-url (it says how that server was started)")
    if args.kv_blocks != parser.get_default("kv_blocks") and args.base_url:
        parser.error("--kv-blocks applies only when the soak starts its own server (--model)")
    if args.kv_blocks < 1 or min(args.request_timeout, args.keepalive_timeout, args.write_timeout) <= 0:
        parser.error("--kv-blocks must be >= 1 and the timeouts > 0")

    if args.base_url:
        try:
            host, port = server_address(args.base_url)
        except ValueError as e:
            parser.error(str(e))

    cfg = SoakConfig(duration=args.duration, streams=args.streams, seed=args.seed)
    tally = Tally()
    if not args.base_url:
        args.model = args.model or "minfer-tiny"
    if args.model:
        try:
            say(f"starting a server on {args.model} ({args.kv_blocks} KV blocks), then {args.duration:g} s of load")
            figures, tally = run_spawned(args.model, cfg, kv_blocks=args.kv_blocks, tally=tally, progress=say)
        except ServerDidNotStart as e:  # the server's own one-line error, no traceback of ours
            print(f"python -m minfer.stress: {e}", file=sys.stderr)
            return 1
    else:
        cfg.write_timeout = args.write_timeout
        cfg.stall_limit = max(args.request_timeout, args.keepalive_timeout) + 10
        cfg.exact_replays = args.float64_server
        try:  # a server that is not there is one line, not the first client's traceback
            socket.create_connection((host, port), timeout=10).close()
        except (OSError, ValueError) as e:
            print(f"python -m minfer.stress: cannot reach {args.base_url}: {getattr(e, 'strerror', None) or e}",
                  file=sys.stderr)
            return 1
        say(f"{args.duration:g} s of load on {args.base_url}")
        figures = soak(Target(host, port, cfg.stall_limit), cfg, tally, progress=say)

    for name, value in figures.items():
        print(f"{name:>55}: {value}")
    for failure in tally.failures:
        print(f"FAIL: {failure}")
    print(f"{len(tally.failures)} failures")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"figures": figures, "failures": tally.failures}, f, indent=1)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
