"""The endpoints that do not generate: health, metrics, the model list, the version, the tokenizer
endpoints and the live view. endpoints.py's APIHandler adds the three that do, and the routes."""

from __future__ import annotations

from typing import Protocol
from urllib.parse import unquote, urlsplit

from .api_errors import APIError
from ..version import __version__
from . import live_view, prometheus, tokenizer_api
from .connections import ConnectionStats
from .http_handler import RoutingHandler
from .manager import SchedulerManager
from .requests import ModelInfo


class ServerState(Protocol):
    """What the handlers read of their server (serve.py's MinferServer has it)."""

    manager: SchedulerManager
    info: ModelInfo
    api_key: str | None
    started: int  # unix time the server started
    stats: ConnectionStats

    def health(self) -> tuple[int, dict]: ...


class InfoEndpoints(RoutingHandler):
    server: ServerState

    def handle_health(self) -> None:
        self.send_json(*self.server.health())

    def model_card(self) -> dict:
        info = self.server.info
        return {
            "id": info.name,
            "object": "model",
            "created": self.server.started,
            "owned_by": "minfer",
            "max_model_len": info.max_model_len,
        }

    def handle_models(self) -> None:
        self.send_json(200, {"object": "list", "data": [self.model_card()]})

    def handle_model(self) -> None:  # GET /v1/models/{id}: what client.models.retrieve(id) reads
        wanted = unquote(urlsplit(self.path).path.removeprefix("/v1/models/"))
        if wanted != self.server.info.name:
            raise APIError(404, f"the model {wanted!r} does not exist", param="model", code="model_not_found")
        self.send_json(200, self.model_card())

    def handle_version(self) -> None:
        self.send_json(200, {"version": __version__})

    def handle_metrics(self) -> None:
        manager = self.server.manager
        text = prometheus.render(manager.metrics, manager.stats()) + prometheus.connection_lines(self.server.stats)
        self.send_body(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def handle_live_page(self) -> None:
        self.send_body(200, live_view.page(), "text/html; charset=utf-8")

    def handle_engine_events(self) -> None:
        self.begin_stream("text/event-stream")
        if self.command == "HEAD":  # the headers only: a HEAD reply has no body
            return
        live_view.stream_events(self.server.manager.events, self.write_chunk, self.end_stream, self.client_gone)

    def handle_tokenize(self) -> None:
        self.send_json(200, tokenizer_api.tokenize(self.read_json(), self.server.info))

    def handle_detokenize(self) -> None:
        self.send_json(200, tokenizer_api.detokenize(self.read_json(), self.server.info))

    def handle_tokenizer_info(self) -> None:
        self.send_json(200, tokenizer_api.tokenizer_info(self.server.info))
