"""`python -m minfer.serve`: an OpenAI-compatible streaming HTTP server on the standard library.

    python -m minfer.serve --model gpt2 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 20, "stream": true}'

This file builds and runs the server: MinferServer (health, graceful stop),
create_server (model -> scheduler -> manager -> server) and the command line.
Threads: ThreadingHTTPServer gives each connection a handler thread. A handler
(endpoints.py, on http_handler.py's routing and writing) parses and tokenizes
the request (requests.py), submits it to the SchedulerManager (manager.py),
whose single worker thread runs the engine, and reads text pieces back from the
request's queue, writing each one as it comes: Server-Sent Events for the
OpenAI endpoints, plain chunked text for /generate. If the client goes away,
the handler releases the request and the worker frees its KV blocks before the
next step. connections.py bounds the rest: request, keep-alive and write
timeouts, and a cap on connections (see its docstring for the defaults and why).
docs/life_of_a_request.md follows one request through every layer.

Endpoints: GET /health, GET /metrics, GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, POST /generate, and the live view: GET / (a page)
and GET /engine/events (live_view.py). With --api-key, the /v1 endpoints,
/generate and /engine/events need `Authorization: Bearer KEY`; /health and
/metrics stay open for probes and scrapers, and the page asks for the key.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, replace

import torch

from ..engine.config import EngineConfig
from ..errors import BadSetting, whole_number
from .. import settings
from ..assembly.build import build_engine, check_device
from ..cpu.threads import cpu_threads_wanted
from ..engine.scheduler import OnlineScheduler
from ..models.loader import resolve_model_dir
from ..text.chat_template import ChatTemplate, check_template_option
from .banner import banner_lines
from .connection_limits import ConnectionLimits, add_arguments, limits_from_args
from .connections import CappedHTTPServer
from .endpoints import APIHandler
from ..engine.generation_defaults import describe as describe_defaults
from ..engine.generation_defaults import sampling_defaults
from .manager import SchedulerManager, check_max_queued
from .requests import ModelInfo
from .metrics import Metrics

log = logging.getLogger("minfer.serve")


class MinferServer(CappedHTTPServer):
    """The HTTP server: one APIHandler thread per connection, in front of one SchedulerManager."""

    request_queue_size = 128  # the listen backlog; socketserver's default of 5 resets bursts of clients
    log_requests = True  # one log line per request; --disable-log-requests turns it off

    def __init__(
        self,
        address,
        manager: SchedulerManager,
        info: ModelInfo,
        api_key: str | None = None,
        limits: ConnectionLimits | None = None,
        engine: dict | None = None,
    ):
        self.manager = manager
        self.info = info
        self.api_key = api_key
        self.engine = engine or {}  # the engine's settings as they run, for /health
        self.started = int(time.time())
        super().__init__(address, APIHandler, limits or ConnectionLimits(), self.health)

    def health(self) -> tuple[int, dict]:
        """(status, body) of GET /health; also answered at the connection cap."""
        paths = self.manager.stats().get("compiled_paths")  # compiled/: what runs now, what fell back
        running = {"engine": self.engine} | ({"compiled_paths": paths} if paths is not None else {})
        if self.manager.is_alive():
            return 200, {"status": "ok", **running}
        reason = self.manager.died_because or "the engine worker is not running"
        return 503, {"status": "unavailable", "reason": reason, **running}

    def stop(self, grace: float = 3.0) -> None:
        """Graceful shutdown: fail in-flight requests (streams get an error chunk), stop accepting, and
        give handlers `grace` seconds to write their last bytes. Call from a thread other than serve_forever's."""
        deadline = time.monotonic() + grace
        self.manager.shutdown()
        self.shutdown()  # serve_forever returns within its 0.5 s poll interval
        self.server_close()
        self.manager.wait_released(grace)
        self.manager.events.wait_viewers_gone(max(0.0, deadline - time.monotonic()))  # they end their streams


# ---- building and running the server -------------------------------------------------


def in_passing_thread(fn):
    """fn() run on a thread that ends with it; its exception, if any, re-raised here.

    The engine thread must be the only thread running torch's OpenMP parallel work: the
    OpenMP runtime (GNU libgomp) stops spin-waiting between parallel regions once more
    of its threads exist than CPUs, and a second team, the one loading the model, would
    cross that line on a small machine: then every parallel region of a step waits for a
    sleeping worker to wake. A team is freed when its thread ends, so the model loads on a
    thread of its own. To see it, compare the decode steps of `bench.py --mode online`
    with `--mode offline` (the engine on the main thread) in their `--trace`."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the caller below
            result["error"] = e

    thread = threading.Thread(target=run, name="minfer-load")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def create_server(
    config: EngineConfig | str = "gpt2",
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queued: int = 128,
    api_key: str | None = None,
    served_model_name: str | None = None,
    limits: ConnectionLimits | None = None,
    chat_template: str | None = None,
    log_requests: bool = True,
    **settings,
) -> MinferServer:
    """Load the model, start the engine worker and bind the socket (port 0 picks a free port).
    `config` is an EngineConfig, or a model name with EngineConfig's fields as `settings`.
    `chat_template` (a file or a Jinja string) replaces the checkpoint's; log_requests=False drops the
    one log line per request. Raises ValueError/OSError for a bad model, setting or address. Run it
    with serve_forever()."""
    check_server_flags(api_key, served_model_name, max_queued)
    if isinstance(config, EngineConfig):
        config = replace(config, **settings)
    else:
        config = EngineConfig(config, **settings)
    device = torch.device(config.device)
    check_device(device)  # before loading anything: a bad start fails in one line, at once
    check_port_free(host, port)
    if chat_template is not None:
        check_template_option(chat_template)  # a mistyped file name or bad Jinja fails now, not after the load

    def build() -> tuple[OnlineScheduler, tuple[dict, list[str]]]:
        model_dir = resolve_model_dir(config.model)  # a Hub id is fetched here
        defaults = sampling_defaults(model_dir, config.generation_config)  # a bad generation_config.json fails now
        # config.json, then the tokenizer and the flags, are checked before the weights load
        return build_engine(replace(config, model=str(model_dir))), defaults

    scheduler, (defaults, not_applied) = in_passing_thread(build)
    language_model, tokenizer = scheduler.model, scheduler.tokenizer
    template = ChatTemplate.from_dir(language_model.model_dir, tokenizer, override=chat_template)
    info = ModelInfo(served_model_name or config.model, tokenizer, scheduler.max_model_len, template, defaults)
    manager = SchedulerManager(scheduler, Metrics(), max_queued=max_queued)
    engine = {k: v for k, v in asdict(scheduler.engine_config).items() if k != "model"}  # no local paths
    if language_model.device.type == "cpu":  # the count the engine was given, chosen by it where the user did not
        engine["num_threads"] = cpu_threads_wanted(engine["num_threads"])
    server = MinferServer((host, port), manager, info, api_key, limits, engine)  # binds now: a taken port fails
    server.log_requests = log_requests
    manager.start()
    bound = "http://{}:{}".format(*server.server_address[:2])
    lines = banner_lines(scheduler, config.dtype, bound, api_key is not None)
    lines.append(describe_defaults(defaults, not_applied, config.generation_config))
    source = "--chat-template" if chat_template else "the checkpoint" if template.source else "plain"
    lines.append(f"chat template: {source}")
    for line in lines:
        log.info("minfer: %s", line)
    return server


def check_server_flags(api_key: str | None, served_model_name: str | None, max_queued: int) -> None:
    """The server's own settings that need no model: a ValueError naming the flag of a bad one."""
    if api_key is not None and not api_key.strip():  # every request would be a 401: an unset shell variable, say
        raise ValueError("--api-key is empty: give a key, or leave the flag out to serve without one")
    if served_model_name is not None and not served_model_name.strip():
        raise ValueError("--served-model-name is empty: give a name, or leave the flag out to serve the model's own")
    check_max_queued(max_queued, "--max-queued")


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process holds before spending a minute loading the model."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is fine
        try:
            probe.bind((host, port))
        except OSError as e:
            held = f" (is another server on port {port}?)" if e.errno == errno.EADDRINUSE else ""
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}{held}") from None


def port_number(text: str) -> int:
    port = whole_number(text)
    if port is None or port > 65535:
        raise argparse.ArgumentTypeError(f"a port must be an integer in [0, 65535], got {text!r}")
    return port


def main(argv: list[str] | None = None, prog: str = "python -m minfer.serve") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server; default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=port_number, default=8000, help="port to listen on (0: any free port; default: %(default)s)"
    )
    EngineConfig.add_cli_arguments(parser)  # --model, --dtype, --block-size, ...
    parser.add_argument(
        "--max-queued", type=int, default=128, help="requests that may wait for a slot; more get 429"
        " (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=settings.API_KEY.get(),
        help="require 'Authorization: Bearer KEY' (default: $MINFER_API_KEY, else none)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one, instead of the checkpoint's")
    parser.add_argument(
        "--disable-log-requests", action="store_true", help="no log line per request (start-up and errors still log)"
    )
    add_arguments(parser)  # timeouts and the connection cap
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log verbosity (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s", stream=sys.stderr)

    try:  # a bad flag value: one line, with argparse's status for a bad argument, before the model loads
        config, limits = EngineConfig.from_cli_args(args), limits_from_args(args)
        check_server_flags(args.api_key, args.served_model_name, args.max_queued)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        server = create_server(
            config,
            host=args.host,
            port=args.port,
            max_queued=args.max_queued,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            limits=limits,
            chat_template=args.chat_template,
            log_requests=not args.disable_log_requests,
        )
    except BadSetting as e:  # a flag this model cannot take: a bad flag still
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    server.manager.on_death = stop.set  # a dead engine never serves again: exit, for a supervisor to restart
    threading.Thread(target=server.serve_forever, name="minfer-http", daemon=True).start()
    host, port = server.server_address[:2]
    print(f"minfer: serving {server.info.name!r} on http://{host}:{port} (Ctrl-C to stop)", flush=True)
    # The main thread only waits for a signal, or the engine's death. A timed wait: a signal the kernel hands
    # to another thread runs our handler only when this thread next runs Python, never from an untimed wait.
    while not stop.wait(0.5):
        pass
    died_because = server.manager.died_because
    log.info("shutting down" + (f": {died_because}" if died_because else ""))
    server.stop(grace=3.0)
    if died_because:
        print(f"minfer: the engine stopped ({died_because}); exiting with status 1", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
