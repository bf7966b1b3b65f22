"""Run many Python scripts, each in its own process, paying the imports once.

`python tests/script_forks.py JOBS.json` imports torch and minfer, then forks one child per job, at
most --parallel at a time. Each child runs its script as `python SCRIPT` would (as __main__, its folder
first on sys.path, sys.argv = [SCRIPT]), with the job's extra environment, its stdout and stderr
written to the job's files. A line of JSON goes to stdout as each job ends: {"index", "returncode",
"seconds"}.

Why: most of a tutorial script's few seconds is importing torch. A fork shares the imported modules
and still gives every script a process of its own. The parent never runs a torch op, so no thread
pool exists yet when it forks.

JOBS.json: [{"script": path, "env": {name: value}, "stdout": path, "stderr": path, "timeout": s}, ...]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback

import torch  # noqa: F401  (the imports every script shares)

import minfer
import minfer.server.serve  # noqa: F401


def run_child(job: dict) -> None:
    """In the forked child: become `python SCRIPT` with the job's environment; never returns."""
    code = 1
    try:
        os.environ.update(job["env"])
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        # Line-buffered, as a terminal's would be: a script killed at its timeout keeps what it printed.
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
        script = os.path.abspath(job["script"])
        sys.argv = [script]
        sys.path.insert(0, os.path.dirname(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        atexit._run_exitfuncs()  # what a normal exit would run (temporary folders, servers)
    except BaseException:  # noqa: BLE001 (a forked child must never return into the loop)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", help="the jobs' JSON file")
    parser.add_argument("--parallel", type=int, default=2, help="children at once")
    args = parser.parse_args()
    with open(args.jobs, encoding="utf-8") as f:
        jobs = json.load(f)
    waiting = list(range(len(jobs)))
    running: dict[int, tuple[int, float, float]] = {}  # pid -> (job index, start, deadline)
    while waiting or running:
        while waiting and len(running) < args.parallel:
            index = waiting.pop(0)
            pid = os.fork()
            if pid == 0:
                run_child(jobs[index])
            start = time.monotonic()
            running[pid] = (index, start, start + jobs[index].get("timeout", 180))
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


if __name__ == "__main__":
    sys.exit(main())
