"""An in-process minfer server for tests: started on a free port, served on a thread, stopped after."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from minfer.server.serve import create_server


@contextmanager
def serving(config, **options):
    """`with serving(EngineConfig(...)) as srv:` the server answers on 127.0.0.1:srv.server_address[1]."""
    srv = create_server(config, port=0, **options)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)
