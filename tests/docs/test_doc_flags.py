"""Every flag the prose names is one its command has, as that command's `--help` lists it:

- a command written out in README.md, docs/ or tutorials/, in a code block or an inline span
  (`python -m minfer.serve ...`, `minfer quantize ...`, `python bench.py ...`, `python scripts/quant_ab.py ...`):
  each of its `--flags` is in that command's `--help`, and a `minfer SUBCOMMAND` is one the command has;
- a flag named alone (`--max-num-seqs`, `--request-timeout 30`, `--ngram-*`): the `--help` of some minfer
  command, or of a script the docs run, lists it. The prose says which command; a flag no command has any more
  (renamed, removed) fails here.

Other programs' commands (lm_eval, curl, llama.cpp's tools) are not checked; their flags named alone are listed in
OTHER_PROGRAMS. test_docs.py checks that the docs' bench.py lines parse; test_readme.py runs the README's commands.
Each test lists every broken item at once, with file and line.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import sys
import warnings
from functools import cache

from markdown_files import DOCS, README, ROOT, TUTORIALS, code_spans, lines_of, rel

from minfer.cli import SUBCOMMANDS

PAGES = [README, *DOCS, *TUTORIALS]
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*\*?")  # `--ngram-*` stands for every flag it begins
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")
# Flags of other programs that the docs name alone, with whose they are.
OTHER_PROGRAMS = {
    "--limit-concurrency": "uvicorn's (docs/reliability.md compares its limits)",
    "--outtype": "llama.cpp's convert_hf_to_gguf.py",
    "--exercise": "the tutorials' scripts (tutorials/_common.py reads it, tests/docs/test_tutorials.py runs it)",
}


def commands(text: str) -> list[str]:
    """The commands of a shell line: `a && b | c; d` is four, each without its environment prefix."""
    parts = re.split(r"&&|\|\||[;|]", text)
    return [ENV_PREFIX.sub("", part.strip()) for part in parts if part.strip()]


def written_commands() -> list[tuple[str, str]]:
    """(file:line, command) of every shell command the pages write out: fenced lines (a trailing backslash joins
    the next) and inline spans."""
    out = []
    for page in PAGES:
        held, held_at = "", None
        for number, line, fenced in lines_of(page):
            if not fenced:
                continue
            if held:
                line = held + " " + line.strip()
            if line.rstrip().endswith("\\"):
                held, held_at = line.rstrip()[:-1], held_at or number
                continue
            out += [(f"{rel(page)}:{held_at or number}", c) for c in commands(line)]
            held, held_at = "", None
        out += [(f"{rel(page)}:{number}", c) for number, span in code_spans(page) for c in commands(span)]
    return out


def command_of(command: str) -> tuple[str, ...] | None:
    """What runs a written command, as a key for `help_flags`: ("module", name, *argv before the flags) or
    ("path", script); None for a command this test does not check (another program, a tutorial stage)."""
    try:
        words = shlex.split(command)
    except ValueError:  # an unclosed quote: a span cut out of a longer line
        words = command.split()
    if words[:2] == ["python", "-m"] and len(words) > 2 and words[2].startswith("minfer"):
        return ("module", words[2])
    if words[:1] == ["minfer"] and len(words) > 1 and not words[1].startswith("-"):
        return ("module", "minfer", words[1])
    if words[:1] == ["python"] and len(words) > 1 and (words[1] == "bench.py" or words[1].startswith("scripts/")):
        if words[1] == "scripts/imitate_cpu.py":  # `imitate_cpu.py KIND bench.py ...`: the command it wraps
            rest = words[3:]
            return command_of(shlex.join(["python", *rest])) if rest else None
        return ("path", words[1])
    return None


@cache
def help_flags(key: tuple[str, ...]) -> frozenset[str] | None:
    """The flags a command's `--help` lists (None if it has no `--help`), run in this process (as the command
    would run, through runpy), the help unwrapped."""
    kind, target, *argv = key
    out, saved_argv, saved_columns = io.StringIO(), sys.argv, os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "1000"  # argparse wraps at the terminal's width: one option a line
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: a package's __main__ another module imported
            if kind == "module":
                sys.argv = [target, *argv, "--help"]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [str(ROOT / target), "--help"]
                runpy.run_path(str(ROOT / target), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            return None
    finally:
        sys.argv = saved_argv
        if saved_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved_columns
    return frozenset(FLAG.findall(out.getvalue())) or None


def has(flags: frozenset[str], flag: str) -> bool:
    if flag.endswith("*"):
        return any(f.startswith(flag[:-1]) for f in flags)
    return flag in flags


def show(key: tuple[str, ...]) -> str:
    if key[0] == "path":
        return f"python {key[1]}"
    return " ".join(key[1:]) if key[1] == "minfer" else f"python -m {key[1]}"


def test_written_commands_use_their_own_flags():
    written = [(where, command, command_of(command)) for where, command in written_commands()]
    checked = [(where, command, key) for where, command, key in written if key and FLAG.search(command)]
    assert len(checked) > 20, f"too few commands with flags found ({len(checked)}): the patterns are broken"
    broken = []
    for where, command, key in checked:
        if key[1] == "minfer" and key[2] not in SUBCOMMANDS:
            broken.append(f"{where}: `{command}`: minfer has no subcommand {key[2]!r} ({', '.join(SUBCOMMANDS)})")
            continue
        flags = help_flags(key)
        if flags is None:
            broken.append(f"{where}: `{command}`: `{show(key)} --help` lists no flags")
            continue
        unknown = [f for f in FLAG.findall(command) if not has(flags, f)]
        if unknown:
            broken.append(f"{where}: `{command}`: `{show(key)} --help` has no {', '.join(unknown)}")
    assert not broken, f"{len(broken)} command(s) with flags their command lacks:\n" + "\n".join(broken)


def every_commands_flags() -> frozenset[str]:
    """The flags of every minfer subcommand, of bench.py, and of every script the pages run."""
    keys = {("module", "minfer", name) for name in SUBCOMMANDS} | {("path", "bench.py")}
    keys |= {key for _, command in written_commands() if (key := command_of(command)) and key[0] == "path"}
    return frozenset().union(*(help_flags(key) or frozenset() for key in keys))


def test_flags_named_alone_exist():
    every = every_commands_flags()
    assert {"--max-num-seqs", "--request-timeout", "--num-requests", "--duration"} <= every, sorted(every)
    missing, seen = [], 0
    for page in PAGES:
        for number, span in code_spans(page):
            if not span.startswith("--"):
                continue
            for flag in FLAG.findall(span):
                seen += 1
                if not has(every, flag) and flag not in OTHER_PROGRAMS:
                    missing.append(f"{rel(page)}:{number}: `{span}`: no minfer command's --help lists {flag}")
    assert seen > 50, f"only {seen} flags named alone: the pattern is broken"
    assert not missing, f"{len(missing)} flag(s) named in the docs that no command has:\n" + "\n".join(missing)


def test_other_programs_flags_are_named_in_the_docs():
    """OTHER_PROGRAMS lists no flag the pages no longer name, nor one a minfer command has."""
    named = {f for page in PAGES for _, span in code_spans(page) for f in FLAG.findall(span)}
    assert set(OTHER_PROGRAMS) <= named, set(OTHER_PROGRAMS) - named
    assert not set(OTHER_PROGRAMS) & every_commands_flags()
