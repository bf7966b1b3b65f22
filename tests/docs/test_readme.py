"""The README's commands work as written: its offline path runs, in order, against a real server
(tests/readme_commands.py says how); every snippet that cannot run here says why, and the Hub
and benchmark commands are still checked as far as they can be without the Hub or minutes to spare."""

import shlex
import subprocess
import sys

import pytest
from readme_commands import (
    README,
    ROOT,
    ReadmeSession,
    hub_model,
    read_record,
    script_env,
    skip_reason,
    snippets,
    starts_server,
    stream_is_whole,
)

SNIPPETS = snippets(README.read_text(encoding="utf-8"))
RUNNABLE = [s for s in SNIPPETS if not skip_reason(s)]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every runnable snippet, run once, in README order (later ones need the server an earlier one starts).
    In CI, .ci/run has just run them with the runtime dependencies only and recorded how each went
    (readme_commands.py --record): those outcomes are checked here, and only the snippets that run
    could not (they need the test extra) run again, with the server they talk to."""
    recorded, server_problems = read_record() or ({}, [])
    results = {id(s): recorded[s.line, s.text] for s in RUNNABLE if (s.line, s.text) in recorded}
    left = [s for s in RUNNABLE if id(s) not in results]
    if left:
        session = ReadmeSession(tmp_path_factory.mktemp("readme"))
        try:
            results |= {id(s): session.run(s) for s in RUNNABLE if s in left or starts_server(s)}
        finally:
            server_problems = server_problems + session.close()
    return results, server_problems


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"line{s.line}" for s in SNIPPETS])
def test_readme_snippet(outcomes, snippet):
    reason = skip_reason(snippet)
    if reason:
        pytest.skip(f"{snippet.label}: {reason}")
    o = outcomes[0][id(snippet)]
    assert not o.problems, (
        f"{snippet.label}\nran: {o.command}\nproblems: {o.problems}\n"
        f"stdout: {o.stdout[-3000:]}\nstderr: {o.stderr[-3000:]}"
    )


def test_the_server_stopped_cleanly(outcomes):
    assert not outcomes[1]


def test_the_offline_path_is_run_not_skipped():
    """minfer-tiny generates -> serve -> curl and the openai client: all run, in that order; a random
    checkpoint is written too."""
    order = [
        next((i for i, s in enumerate(RUNNABLE) if key in s.text), None)
        for key in ("minfer.generate --model minfer-tiny", "minfer.serve", "curl", "OpenAI(")
    ]
    assert None not in order, [s.label for s in RUNNABLE]
    assert order == sorted(order)
    assert any("minfer.random_model" in s.text for s in RUNNABLE)


def test_streamed_completion_has_text(outcomes):
    """The curl completion example streams Server-Sent Events that carry text (or stop at once) and end with [DONE]."""
    results = outcomes[0]
    streams = [results[id(s)].stdout for s in RUNNABLE if "/v1/completions" in s.text and '"stream": true' in s.text]
    assert streams and all(stream_is_whole(out) for out in streams)


def test_hub_snippets_stop_only_at_the_hub(tmp_path):
    """With no Hub and an empty cache, each Hub snippet gets as far as fetching the model and says
    so: its flags and code are fine, and it fails with the loader's message (the CLI without a traceback)."""
    hub = [s for s in SNIPPETS if hub_model(s) and not s.text.startswith("pip")]
    assert hub, "the README names no Hub model: the Qwen3 serve line should"
    env = {**script_env(), "HF_HOME": str(tmp_path / "empty-hf-home")}
    for s in hub:
        argv = ["bash", "-c", s.text] if s.lang == "bash" else [sys.executable, "-c", s.text]
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        message = f"could not get model {hub_model(s)!r} from the Hugging Face Hub"
        assert done.returncode == 1 and message in done.stderr, (s.label, done.stdout, done.stderr)
        if s.lang == "bash":
            assert "Traceback" not in done.stderr, (s.label, done.stderr)


def test_bench_commands_parse(monkeypatch):
    """bench.py's README lines are benchmarks (minutes each): check that their flags are bench.py's."""
    from minfer.bench import cli as bench

    lines = [s.text for s in SNIPPETS if s.lang == "bash" and s.text.startswith("python bench.py")]
    assert lines
    for line in lines:
        argv = shlex.split(line)[2:]  # a $VARIABLE stays as it is: any string will do for a path
        try:
            bench.parse_args(argv)
        except SystemExit:
            pytest.fail(f"bench.py rejects the README's flags: {line}")
