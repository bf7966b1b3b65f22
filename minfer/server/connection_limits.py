"""Connection limits for the HTTP server, and their flags: four numbers, each a flag of
`python -m minfer.serve`. --request-timeout: a whole request must arrive in time, else 408.
--keepalive-timeout: idle kept-alive connections close. --write-timeout: a write blocked on a client
that stopped reading ends its stream. --max-connections: beyond it a quick 503 (/health still
answers). docs/reliability.md gives each default and why, beside uvicorn's and nginx's;
connections.py enforces them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


MAX_SECONDS = 10**8  # 3 years, as good as none: a socket timeout past time_t's range fails every read


@dataclass(frozen=True)
class ConnectionLimits:
    request_timeout: float = 30.0  # seconds for a whole request: line, headers, body
    keepalive_timeout: float = 15.0  # seconds an idle kept-alive connection stays open
    write_timeout: float = 30.0  # seconds one write may stay blocked on a client that doesn't read
    max_connections: int = 512  # connections served at once; more get 503

    def __post_init__(self):
        for name in ("request_timeout", "keepalive_timeout", "write_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:  # NaN, inf too
                raise ValueError(f"{name} must be a number of seconds > 0, at most {MAX_SECONDS:,}, got {value!r}")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ValueError(f"max_connections must be an integer >= 1, got {self.max_connections!r}")


FLAG_HELP = {  # one --flag per ConnectionLimits field
    "request_timeout": "seconds a client has to send a whole request (headers and body); else 408",
    "keepalive_timeout": "seconds an idle keep-alive connection stays open",
    "write_timeout": "seconds a write may block on a client that stopped reading; then its stream ends",
    "max_connections": "connections served at once; more get a quick 503",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ConnectionLimits):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default,
                            help=FLAG_HELP[f.name] + " (default: %(default)s)")


def limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    """The limits the flags set; a bad value is a ValueError naming its flag."""
    try:
        return ConnectionLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ConnectionLimits)})
    except ValueError as e:  # "request_timeout must be ..." -> "--request-timeout must be ..."
        field, rest = str(e).split(" ", 1)
        raise ValueError(f"--{field.replace('_', '-')} {rest}") from None
