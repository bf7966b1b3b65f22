"""The README's commands, taken from its fenced code blocks and run in the order written.

Each ```bash line (continuations joined) and each ```python block is a snippet. A snippet
either runs, or is skipped for a stated reason (it needs the Hub, installs packages, is a
benchmark...). Running ones go through a few substitutions, each said below, and must exit 0,
print something, print no warning and no error; a `python -m minfer.serve` line is started
in the background, and every later snippet that talks to it must get status 200 in its log.

tests/docs/test_readme.py runs this under pytest; .ci/run also runs it in a virtual environment
holding minfer's runtime dependencies only (standard library here, nothing else):

    python tests/readme_commands.py [--config-as-written] [--record FILE]

--record writes what ran and how it went to FILE. .ci/run passes it on to pytest in
$MINFER_README_RECORD, so test_readme checks those outcomes instead of running the same commands
again, and runs only what the first run could not (the openai examples), with the server they need.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_PORT = "8000"
RUN_TIMEOUT = 300  # seconds for one command: generous, the machine may be busy
REQUEST_LINE = re.compile(r'"(?:GET|POST|PUT|DELETE|PATCH|OPTIONS|HEAD) (\S+)" (\d{3})')
HUB_REASON = (
    "loads {!r} from the Hugging Face Hub, unreachable here "
    "(test_readme runs it offline: it must fail only for want of the Hub)"
)
SERVING_LINE = re.compile(r"serving .* on http://([\d.]+):(\d+)")


@dataclass
class Snippet:
    lang: str  # "bash" (one command) or "python" (one whole block)
    text: str
    line: int  # where it starts in README.md

    @property
    def label(self) -> str:
        first = self.text.splitlines()[0]
        return f"README.md:{self.line}: {first[:70]}"


@dataclass
class Outcome:
    command: str  # what ran, after the substitutions
    returncode: int
    stdout: str
    stderr: str
    problems: list[str] = field(default_factory=list)


RECORD_ENV = "MINFER_README_RECORD"


def write_record(path: Path, ran: list[tuple[Snippet, Outcome]], server_problems: list[str]) -> None:
    """What ran (keyed by README line and text) and how it went, for test_readme to check."""
    record = {
        "readme_sha256": hashlib.sha256(README.read_bytes()).hexdigest(),
        "ran": [{"line": s.line, "text": s.text, **o.__dict__} for s, o in ran],
        "server_problems": server_problems,
    }
    path.write_text(json.dumps(record), encoding="utf-8")


def read_record() -> tuple[dict[tuple[int, str], Outcome], list[str]] | None:
    """The record $MINFER_README_RECORD names: {(line, text): outcome} and the server's problems.
    None when unset, or written for another README (a stale record checks nothing)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return None
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    if record["readme_sha256"] != hashlib.sha256(README.read_bytes()).hexdigest():
        return None
    ran = {(r.pop("line"), r.pop("text")): Outcome(**r) for r in record["ran"]}
    return ran, record["server_problems"]


def starts_server(snippet: Snippet) -> bool:
    return snippet.lang == "bash" and "minfer.serve" in snippet.text


def fenced_blocks(markdown: str) -> list[tuple[str, str, int]]:
    """(language, body, line of the body's first line) for every ``` block."""
    blocks, lang, body, start = [], None, [], 0
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, body, start = line[3:].strip(), [], number + 1
            else:
                blocks.append((lang, "\n".join(body), start))
                lang = None
        elif lang is not None:
            body.append(line)
    if lang is not None:
        raise ValueError(f"README.md: the ``` block opened at line {start - 1} is never closed")
    return blocks


def snippets(markdown: str) -> list[Snippet]:
    out = []
    for lang, body, start in fenced_blocks(markdown):
        if lang == "python":
            out.append(Snippet("python", body, start))
        elif lang in ("bash", "sh", "shell"):
            lines = body.splitlines()
            i = 0
            while i < len(lines):
                first, command = i, lines[i]
                while command.endswith("\\") and i + 1 < len(lines):  # a continued line
                    i += 1
                    command += "\n" + lines[i]  # bash reads backslash-newline as a continuation
                i += 1
                if command.strip() and not command.lstrip().startswith("#"):
                    out.append(Snippet("bash", command.strip(), start + first))
        else:
            raise ValueError(f"README.md:{start}: a ```{lang} block; the README test knows bash and python only")
    return out


def hub_model(snippet: Snippet) -> str | None:
    """The Hub id a snippet loads (`--model gpt2`, `LLM("gpt2")`), or None for a local path or a model
    shipped in the package (minfer-tiny)."""
    from minfer.models.loader import BUILTIN_MODELS

    if snippet.lang == "bash" and snippet.text.startswith("lm_eval"):
        return None  # its --model names the harness's client (local-completions), not a checkpoint
    pattern = r"--model[ =](\S+)" if snippet.lang == "bash" else r"LLM\(\s*[\"']([^\"']+)[\"']"
    for name in re.findall(pattern, snippet.text):
        if not name.startswith(("/", ".", "~", "$")) and name not in BUILTIN_MODELS:
            return name
    return None


def skip_reason(snippet: Snippet) -> str | None:
    """Why a snippet cannot run here, or None if it runs."""
    text = snippet.text
    if snippet.lang == "bash":
        if re.match(r"pip3? install", text):
            return "installs packages, which .ci/run does in fresh environments"
        if "pytest" in text:
            return "runs the test suite, which this test is part of"
        if "bench.py" in text:
            return ("a benchmark that runs for minutes: test_readme checks its flags, tests/clients/test_bench.py runs "
                    "bench.py")
        if text.startswith("lm_eval"):
            return ("an evaluation that runs for minutes on Hub datasets: tests/clients/test_lm_eval.py runs lm-eval "
                    "on a local task")
        if "minfer.stress" in text:
            return ("a soak that runs for a minute and sends bad requests on purpose: tests/clients/test_stress.py "
                    "runs it")
        if re.fullmatch(r"\w+=\S*", text):
            return "only sets a shell variable"
        if hub_model(snippet):
            return HUB_REASON.format(hub_model(snippet))
        if text.startswith("curl") and not shutil.which("curl"):
            return "curl is not installed"
        return None
    if hub_model(snippet):
        return HUB_REASON.format(hub_model(snippet))
    for node in ast.walk(ast.parse(text)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        for name in names:
            top = name.split(".")[0]
            if importlib.util.find_spec(top) is None:
                return f"needs the {top} package (pip install {top}), which is not installed here"
    return None


def script_env() -> dict:
    """`python` in a command is the interpreter running this, and nothing reaches for the Hub."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _drain(stream, put) -> None:
    """Pass each line of a pipe on, until it closes: a full pipe would stall the server."""
    for line in stream:
        put(line)
    put("")


def sse_data(stdout: str) -> list[str]:
    """The payloads of a Server-Sent Events stream's `data:` lines, in order."""
    return [line[len("data: ") :] for line in stdout.splitlines() if line.startswith("data: ")]


def sse_text(stdout: str) -> str | None:
    """The text a Server-Sent Events completion stream carried, or None if stdout is not one. A stream
    without its final [DONE] carries "". So does one whose model ended at once: then its last
    finish_reason is "stop" (see stream_is_whole)."""
    import json

    data = sse_data(stdout)
    if not data:
        return None
    if data[-1] != "[DONE]":
        return ""
    chunks = [json.loads(d) for d in data[:-1]]
    return "".join(
        c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
        for c in chunks
        if c.get("choices")
    )


def stream_is_whole(stdout: str) -> bool:
    """A completion stream that carried text and ended with [DONE], or that ended at once because its
    model stopped (end-of-sequence as the first token: the README's random checkpoints have a
    512-token vocabulary, so an unseeded request draws it now and then)."""
    import json

    if (sse_text(stdout) or "").strip():
        return True
    data = sse_data(stdout)
    if len(data) < 2 or data[-1] != "[DONE]":
        return False
    last = json.loads(data[-2]).get("choices") or [{}]
    return last[0].get("finish_reason") == "stop"


class ReadmeSession:
    """Runs snippets in README order. Substitutions, so that a run never touches what a user has:
    - paths under /tmp/ go to a scratch directory;
    - the server listens on a free port (--port 0), and clients' port 8000 becomes that port;
    - `--config gpt2` becomes `--config tiny`, the README's own alternative (1 s to write instead
      of ~13 s, and a faster model to load and run), unless config_as_written."""

    def __init__(self, scratch: Path, config_as_written: bool = False):
        self.scratch = Path(scratch)
        self.config_as_written = config_as_written
        self.env = script_env()
        self.server: subprocess.Popen | None = None
        self.server_port: str | None = None
        self.server_log: list[str] = []  # the server's stderr lines, as they come

    def substitute(self, text: str) -> str:
        text = re.sub(r"(?<![\w/])/tmp/", f"{self.scratch}/", text)
        if not self.config_as_written:
            text = text.replace("--config gpt2", "--config tiny")
        if self.server_port:
            text = re.sub(rf"(?<=[: ]){README_PORT}\b", self.server_port, text)
        return text

    def run(self, snippet: Snippet) -> Outcome:
        if starts_server(snippet):
            return self._start_server(snippet)
        command = self.substitute(snippet.text)
        argv = ["bash", "-c", command] if snippet.lang == "bash" else [sys.executable, "-c", command]
        log_before = len(self.server_log)
        done = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        outcome = Outcome(command, done.returncode, done.stdout, done.stderr)
        self._check_output(outcome)
        if self.server is not None and re.search(rf"(?<=[: ]){README_PORT}\b", snippet.text):
            self._check_server_answered(outcome, log_before)
        return outcome

    def _check_output(self, o: Outcome) -> None:
        if o.returncode != 0:
            o.problems.append(f"exit status {o.returncode}")
        if re.search("warning", o.stderr, re.IGNORECASE):
            o.problems.append("printed a warning")
        if not o.stdout.strip():
            o.problems.append("printed nothing")
        if '"error"' in o.stdout:
            o.problems.append("got an error response")
        if sse_text(o.stdout) is not None and not stream_is_whole(o.stdout):
            o.problems.append("a stream without text, or without its final [DONE]")

    def _check_server_answered(self, o: Outcome, log_before: int) -> None:
        """Every request the command made is in the server's log with status 200 (a line is
        logged just after the response is sent, so wait a moment for it)."""
        deadline = time.monotonic() + 10
        requests = []
        while not requests and time.monotonic() < deadline:
            time.sleep(0.05)
            requests = [m for line in self.server_log[log_before:] if (m := REQUEST_LINE.search(line))]
        if not requests:
            o.problems.append("the server logged no request from it")
        for m in requests:
            if m.group(2) != "200":
                o.problems.append(f"the server answered {m.group(1)} with status {m.group(2)}")

    def _start_server(self, snippet: Snippet) -> Outcome:
        if self.server is not None:
            raise RuntimeError(f"{snippet.label}: a second server; the README test runs one")
        command = self.substitute(snippet.text)
        command = re.sub(rf"--port[ =]{README_PORT}\b", "--port 0", command)
        if "--port" not in command:
            command += " --port 0"
        # exec: the server replaces bash, so the signal below reaches it; it stays in our process
        # group, so a Ctrl-C that stops this run stops it too.
        self.server = subprocess.Popen(
            ["bash", "-c", "exec " + command],
            cwd=ROOT,
            env=self.env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        stdout: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_drain, args=(self.server.stdout, stdout.put), daemon=True).start()
        threading.Thread(target=_drain, args=(self.server.stderr, self.server_log.append), daemon=True).start()
        try:  # "minfer: serving ... on http://HOST:PORT" comes once it listens; "" if it exits first
            first = stdout.get(timeout=RUN_TIMEOUT)
        except queue.Empty:
            first = ""
        outcome = Outcome(command, self.server.poll() or 0, first, "")
        if m := SERVING_LINE.search(first):
            self.server_port = m.group(2)
        else:
            outcome.problems.append(f"did not start serving; it printed {first!r}, then {self.server_log[-10:]}")
        return outcome

    def close(self) -> list[str]:
        """Stop the server (Ctrl-C's signal); returns problems seen in its log."""
        if self.server is None:
            return []
        self.server.send_signal(signal.SIGTERM)
        try:
            code = self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
            self.server = None
            return ["the server did not stop within 30 s of SIGTERM"]
        problems = [f"the server exited with status {code}"] if code != 0 else []
        if any(re.search("warning|traceback", line, re.IGNORECASE) for line in self.server_log):
            problems.append("the server logged a warning or a traceback:\n" + "".join(self.server_log[-20:]))
        self.server = None
        return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-as-written", action="store_true", help="keep `--config gpt2` (slower)")
    parser.add_argument("--record", type=Path, help="write what ran and how it went here (JSON)")
    args = parser.parse_args(argv)
    ran: list[tuple[Snippet, Outcome]] = []
    server_problems: list[str] = []
    # Killed (CI timeout, kill PID): stop the server on the way out, as for Ctrl-C.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    failures = 0
    with tempfile.TemporaryDirectory(prefix="minfer-readme-") as scratch:
        session = ReadmeSession(Path(scratch), args.config_as_written)
        try:
            for snippet in snippets(README.read_text(encoding="utf-8")):
                reason = skip_reason(snippet)
                if reason:
                    print(f"SKIP {snippet.label}\n     {reason}", flush=True)
                    continue
                start = time.perf_counter()
                outcome = session.run(snippet)
                ran.append((snippet, outcome))
                verdict = "FAIL" if outcome.problems else "ok  "
                print(f"{verdict} {snippet.label} ({time.perf_counter() - start:.1f} s)", flush=True)
                if outcome.problems:
                    failures += 1
                    print(
                        f"     ran: {outcome.command}\n     problems: {outcome.problems}\n"
                        f"     stdout: {outcome.stdout[-2000:]}\n     stderr: {outcome.stderr[-2000:]}"
                    )
        finally:
            server_problems = session.close()
            for problem in server_problems:
                failures += 1
                print(f"FAIL server: {problem}")
            if args.record:
                write_record(args.record, ran, server_problems)
    print("README commands: " + ("all ran as written" if not failures else f"{failures} failed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
