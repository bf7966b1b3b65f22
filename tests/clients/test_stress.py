"""The soak and fault suite (minfer.stress) against a real server process: a short run for CI.

For the long run: MINFER_SOAK_SECONDS=60 pytest tests/clients/test_stress.py, or `python -m minfer.stress`."""

import glob
import os
import tempfile
import time

import pytest

from minfer.stress import soak
from minfer.stress.__main__ import main
from minfer.stress.clients import Tally
from minfer.stress.soak import SoakConfig, replay, run_spawned

SECONDS = float(os.environ.get("MINFER_SOAK_SECONDS", "12"))


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_soak_with_faults_then_sigterm(tiny_checkpoint, make_checkpoint, proposer, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the soak keeps its server log: others' runs apart
    # With speculation on: seeded streams speculate in any batch, the others when few run, so speculating
    # and plain sequences share the steps (and their preemptions and cancellations). A draft model keeps a
    # KV cache of its own on the target's blocks: the block count at the end checks both.
    server_args = ("--speculative-method", proposer)
    if proposer == "draft":  # the target's first layer: same vocabulary, right now and then
        server_args += ("--speculative-model", str(make_checkpoint("tiny", n_layer=1)))
    cfg = SoakConfig(duration=SECONDS, replays=8, server_args=server_args)
    progress = []
    figures, tally = run_spawned(str(tiny_checkpoint), cfg, kv_blocks=48, progress=progress.append)
    print("\n".join(f"{k}: {v}" for k, v in figures.items()))
    assert tally.failures == []
    assert progress and all("streams finished" in line for line in progress)  # heard while the load ran
    assert figures["load seconds"] < SECONDS + 10  # the load lasts what was asked (streams are cut at its end)
    counts = [v for k, v in figures.items() if not k.startswith(("load", "/health", "RSS", "seconds"))]
    assert all(not isinstance(v, float) for v in counts), figures  # counts print as integers
    # every fault really happened, so the checks above had something to check
    assert figures["streams finished"] > 0 and figures["streams cancelled midway"] > 0
    assert figures["of them with n > 1 choices"] > 0  # n > 1 and penalty requests are in the mix
    assert figures["preemptions"] > 0 and figures["requests discarded by the server"] > 0
    assert figures["speculative proposals accepted"] > 0
    assert figures["slow-reader streams finished"] > 0
    assert figures["scoring requests answered (echo + logprobs)"] > 0 and figures["logprob streams finished"] > 0
    assert figures["constrained requests answered"] > 0  # and every output that stopped met its constraint
    assert figures["constrained outputs that stopped (each meets its constraint)"] > 0
    assert figures["tool requests answered"] > 0
    assert figures["tool calls returned (each naming a tool, its arguments valid)"] > 0
    assert figures["stalled requests closed with 408"] > 0 and figures["silent connections closed"] > 0
    assert figures["idle keep-alive connections closed"] > 0
    assert figures["malformed requests answered 4xx"] > 0 and figures["/metrics scrapes"] > 0
    assert figures["seeded streams replayed alone, identical"] == "8/8"
    assert figures["KV blocks free at the end"] == "48/48"
    assert figures["streams open at SIGTERM"] == figures["streams ended with an error event and [DONE]"] > 0
    assert figures["exit code after SIGTERM"] == 0 and figures["stack traces in the server log"] == 0
    # a clean run leaves no server log behind in /tmp
    assert "server log" not in figures
    assert glob.glob(os.path.join(tmp_path, "minfer-stress-*")) == []


def test_cli_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--base-url", "http://127.0.0.1:1", "--duration", "0"])
    assert e.value.code == 2
    assert "--duration must be > 0" in capsys.readouterr().err


def test_a_replay_that_differs_fails_only_where_replays_must_be_exact(monkeypatch):
    """The spawned server runs float64, where a seeded replay must match; a server of someone else's
    (fp32 or bf16: rounding can move a draw) gets its differences counted, not failed."""
    monkeypatch.setattr(soak, "run_stream", lambda target, body, tally: "same")
    for exact, failures in ((False, 0), (True, 1)):
        tally = Tally()
        tally.finished = [({"seed": 1}, "same"), ({"seed": 2}, "other")]
        assert replay(None, SoakConfig(replays=2, exact_replays=exact), tally) == 1
        assert len(tally.failures) == failures


def test_cli_names_a_server_that_is_not_there(capsys):
    assert main(["--base-url", "http://127.0.0.1:1", "--duration", "1"]) == 1
    assert capsys.readouterr().err == "python -m minfer.stress: cannot reach http://127.0.0.1:1: Connection refused\n"


@pytest.mark.parametrize("argv, message", [
    (["--request-timeout", "5"], "--request-timeout applies only with --base-url"),  # ours starts with its own
    (["--model", "minfer-tiny", "--float64-server"], "--float64-server applies only with --base-url"),
    (["--base-url", "http://127.0.0.1:1", "--kv-blocks", "8"], "--kv-blocks applies only when the soak starts"),
    (["--kv-blocks", "0"], "--kv-blocks must be >= 1 and the timeouts > 0"),
    # The soak speaks plain HTTP to the server's own paths: TLS or a path before /v1 would be dropped unsaid.
    (["--base-url", "https://127.0.0.1:1"], "--base-url must look like http://HOST:PORT (the soak speaks plain HTTP "
                                             "to the server's own paths), got 'https://127.0.0.1:1'"),
    (["--base-url", "http://127.0.0.1:1/proxy/v1"], "got 'http://127.0.0.1:1/proxy/v1'"),
    (["--base-url", "http://127.0.0.1:99999"], "got 'http://127.0.0.1:99999'"),
])
def test_cli_refuses_flags_it_would_not_apply(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--duration", "1"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_tool_requests_to_a_server_without_a_tool_template_are_not_failures(tiny_checkpoint):
    """--base-url at a server whose chat template renders no tools (minfer-tiny's): its 400 is right, and the
    constrained client counted every one of them as a failure of the server (217 in a 2-minute run)."""
    from serving import serving

    from minfer import EngineConfig
    from minfer.stress.clients import Target
    from minfer.stress.constrained import constrained

    with serving(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64)) as srv:
        tally = Tally()
        constrained(Target("127.0.0.1", srv.server_address[1], stall_limit=10), tally, time.monotonic() + 4, seed=3)
    assert tally.failures == []
    assert tally.counts["tool requests refused: the chat template renders no tools"] == 1  # then none are sent
    assert tally.counts["constrained requests answered"] > 0
