"""Run many Python commands, each in its own process, paying the imports once.

`python tests/script_forks.py JOBS.json` imports torch (or the --preload modules), then forks one
child per job, at most --parallel at a time. Each child runs its command as `python ARGV...` would: a
script (as __main__, its folder first on sys.path), `-m MODULE` or `-c CODE`, with sys.argv set, in the
job's working folder and environment, its stdout and stderr written to the job's files. A line of JSON
goes to stdout as each job ends: {"index", "returncode", "seconds"}. With JOBS.json `-` the jobs come
one a line on stdin, as long as it stays open: `run_python` below keeps such a process per test process.

Why: most of a short command's few seconds is importing torch. A fork shares the imported modules
and still gives every command a process of its own. The parent never runs a torch op, so torch's
thread pool does not exist yet when it forks.

A job: {"argv": [...the command line after `python`], "env": {name: value}, "stdout": path,
"stderr": path, "timeout": s}, and optionally "cwd" and "replace_env" (the job's env is the whole
environment, not additions to the parent's).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import runpy
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path


def run_child(job: dict) -> None:
    """In the forked child: become `python ARGV...`; never returns."""
    code = 1
    try:
        if job.get("replace_env"):
            os.environ.clear()
        os.environ.update(job["env"])
        tempfile.tempdir = None  # found again from TMPDIR, as a fresh interpreter would
        os.chdir(job.get("cwd") or os.getcwd())
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        # Line-buffered, as a terminal's would be: a command killed at its timeout keeps what it printed.
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
        try:
            run_argv(job["argv"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException as e:  # noqa: BLE001 (as Python prints it, without this file's two frames)
            traceback.print_exception(type(e), e, e.__traceback__.tb_next.tb_next)
        # What a normal exit runs: wait for the threads still running, then the exit functions.
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 (a forked child must never return into the loop)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_argv(argv: list[str]) -> None:
    """What `python ARGV...` runs, with sys.argv and sys.path[0] as it would set them."""
    if argv[0] == "-m":
        sys.argv = argv[1:]  # run_module puts the module's file in sys.argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        script = os.path.abspath(argv[0])
        sys.argv = argv
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


class JobLines:
    """Jobs sent one a line on a pipe, read as they come (on the file descriptor: nothing waits in a buffer)."""

    def __init__(self, fd: int):
        self.fd, self.pending, self.open = fd, b"", True

    def read(self, wait: float | None) -> list[dict]:
        """The jobs that have come, after waiting up to `wait` seconds (None: until one comes) for any."""
        jobs = []
        while self.open and select.select([self.fd], [], [], wait)[0]:
            data = os.read(self.fd, 65536)
            self.open = bool(data)
            *lines, self.pending = (self.pending + data).split(b"\n")
            jobs += [json.loads(line) for line in lines]
            wait = 0 if jobs else wait
        return jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", help="the jobs' JSON file, or - for one job a line on stdin")
    parser.add_argument("--parallel", type=int, default=2, help="children at once")
    parser.add_argument("--preload", default="torch", help="the modules the commands share, imported first")
    args = parser.parse_args()
    for name in args.preload.split(","):
        importlib.import_module(name)
    jobs, lines = [], JobLines(sys.stdin.fileno())
    if args.jobs != "-":
        with open(args.jobs, encoding="utf-8") as f:
            jobs, lines = json.load(f), None
    waiting = list(range(len(jobs)))
    running: dict[int, tuple[int, float, float]] = {}  # pid -> (job index, start, deadline)
    while waiting or running or (lines and lines.open):
        if lines:  # new jobs: while children run, a glance; else wait for one
            more = lines.read(0 if running or waiting else None)
            waiting += range(len(jobs), len(jobs) + len(more))
            jobs += more
        while waiting and len(running) < args.parallel:
            index = waiting.pop(0)
            pid = os.fork()
            if pid == 0:
                run_child(jobs[index])
            start = time.monotonic()
            running[pid] = (index, start, start + jobs[index].get("timeout", 180))
        if not running:
            continue
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for late, (_, _, deadline) in running.items():
                if now > deadline:
                    os.kill(late, signal.SIGKILL)  # reported below as killed by signal 9
            time.sleep(0.02)
            continue
        index, start, _ = running.pop(pid)
        returncode = os.waitstatus_to_exitcode(status)
        seconds = round(time.monotonic() - start, 2)
        print(json.dumps({"index": index, "returncode": returncode, "seconds": seconds}), flush=True)
    return 0


# ---- in a test: `run_python`, subprocess.run's twin for a Python command ---------------------------------

# What a fork cannot change: variables read as the interpreter or torch's OpenMP (GNU's: KMP_ variables,
# which lm-eval sets, are Intel's) start. A command whose environment sets them differently needs a fresh
# interpreter: subprocess.run.
READ_AT_START = ("PYTHON", "OMP_", "GOMP_", "MKL_", "LD_", "MALLOC_", "TORCH_")
_server: dict = {}  # this process's forking process, once started: {"proc", "jobs", "lock", "out"}
_START_ENV = dict(os.environ)  # as the tests found it, whatever a test sets later


def run_python(argv: list[str], *, cwd=None, env=None, timeout=None) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True, ...)` for a Python command (`[sys.executable,
    ...]`, or a console script of this environment's), run in a fork of a process that has imported torch
    (but not minfer: the command imports minfer itself, as it would in a fresh interpreter)."""
    env = dict(os.environ if env is None else env)
    changed = {k for k in {*env, *_START_ENV} if k.startswith(READ_AT_START) and env.get(k) != _START_ENV.get(k)}
    if changed:
        raise ValueError(f"{shlex.join(argv)}: its environment changes what an interpreter reads at start: {changed}")
    if not _server:
        _server["proc"] = subprocess.Popen(
            [sys.executable, __file__, "-"], env=_START_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        _server.update(jobs=0, lock=threading.Lock(), out=tempfile.mkdtemp(prefix="script-forks-"))
        atexit.register(stop_server)
    with _server["lock"]:
        index, out = _server["jobs"], os.path.join(_server["out"], str(_server["jobs"]))
        _server["jobs"] += 1
        job = {"argv": python_argv(argv), "env": env, "replace_env": True, "cwd": str(cwd or os.getcwd()),
               "stdout": out + ".out", "stderr": out + ".err", "timeout": timeout or 600}
        _server["proc"].stdin.write(json.dumps(job) + "\n")
        _server["proc"].stdin.flush()
        line = _server["proc"].stdout.readline()
    if not line:
        raise RuntimeError(f"tests/script_forks.py exited with {_server['proc'].poll()}")
    done = json.loads(line)
    assert done["index"] == index, (done, index)
    stdout, stderr = (Path(out + ext).read_text(encoding="utf-8", errors="replace") for ext in (".out", ".err"))
    os.remove(out + ".out")
    os.remove(out + ".err")
    if done["returncode"] == -signal.SIGKILL and done["seconds"] >= job["timeout"]:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(argv, done["returncode"], stdout, stderr)


def stop_server() -> None:
    """At exit: no more jobs, so the forking process ends (once its children have), and is waited for."""
    _server["proc"].stdin.close()
    try:
        _server["proc"].wait(30)
    except subprocess.TimeoutExpired:
        _server["proc"].kill()
        _server["proc"].wait()
    shutil.rmtree(_server["out"], ignore_errors=True)


def python_argv(argv: list[str]) -> list[str]:
    """The command line after `python`: argv less this interpreter, or a console script as a script."""
    if argv[0] == sys.executable:
        return argv[1:]
    with open(argv[0], encoding="utf-8") as f:
        interpreter = f.readline().strip().removeprefix("#!")
    if os.path.dirname(interpreter) == os.path.dirname(sys.executable):  # this environment's
        return argv
    raise ValueError(f"{shlex.join(argv)}: not a command of this Python")


if __name__ == "__main__":
    sys.exit(main())
