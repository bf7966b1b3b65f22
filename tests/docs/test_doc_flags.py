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
    if words and words[0].endswith(".py") and not words[0].startswith("tutorials/"):  # `bench.py --n 4`, `quant_ab.py`
        script = words[0] if words[0] == "bench.py" or "/" in words[0] else f"scripts/{words[0]}"
        return command_of(shlex.join(["python", script, *words[1:]])) if (ROOT / script).is_file() else None
    if words[:1] == ["python"] and len(words) > 1 and (words[1] == "bench.py" or words[1].startswith("scripts/")):
        if words[1] == "scripts/imitate_cpu.py":  # `imitate_cpu.py KIND bench.py ...`: the command it wraps
            rest = words[3:]
            return command_of(shlex.join(["python", *rest])) if rest else None
        return ("path", words[1])
    return None


@cache
def help_text(key: tuple[str, ...]) -> str | None:
    """A command's `--help` (None if it has none), run in this process as the command would run (runpy), one
    option a line."""
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
    return out.getvalue() or None


def help_flags(key: tuple[str, ...]) -> frozenset[str] | None:
    """The flags a command's `--help` lists (None if it has no `--help`)."""
    return frozenset(FLAG.findall(help_text(key) or "")) or None


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


SERVE = ("module", "minfer", "serve")


def stated_defaults() -> list[tuple[str, str, str]]:
    """(file:line, flag, default) from the docs' tables that give flags' defaults: a "flag (default)" column of
    `--flag VALUE` spans (reliability.md), or a "flag" column beside a "default" one (speculative.md: `--a`,
    `--b` | 2, 4)."""
    out = []
    for page in DOCS:
        header = None
        for number, line, fenced in lines_of(page):
            if fenced or not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
                continue
            if set(cells[0]) <= set("-: "):
                continue  # the separator row
            where = f"{rel(page)}:{number}"
            if "flag (default)" in header:
                for flag, value in re.findall(r"`(--[a-z][\w-]*) ([^`]+)`", cells[header.index("flag (default)")]):
                    out.append((where, flag, value))
            elif "flag" in header and "default" in header:
                flags = FLAG.findall(cells[header.index("flag")])
                values = [v.strip() for v in cells[header.index("default")].split(",")]
                out += [(where, flag, value) for flag, value in zip(flags, values)] if len(flags) == len(values) else [
                    (where, ", ".join(flags), f"{len(values)} defaults for {len(flags)} flags")]
    return out


def options(help: str) -> dict[str, str]:
    """--help's text for each option: its line, and the next ones where the flag is too long to share one."""
    out, current = {}, None
    for line in help.splitlines():
        if line.startswith("  -"):
            current = FLAG.match(line.strip()).group(0) if FLAG.match(line.strip()) else None
            if current:
                out[current] = line
        elif current and line.startswith("    "):
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def same(stated: str, shown: str) -> bool:
    try:
        return float(stated) == float(shown)
    except ValueError:
        return stated.lower() == shown.lower()


def test_flag_defaults_in_the_docs_are_the_servers():
    """The defaults the docs' tables give (reliability.md's timeouts, speculative.md's options) are the ones
    `minfer serve --help` shows; "none" in the docs: the help shows none, or says none."""
    rows = stated_defaults()
    assert len(rows) >= 8, f"only {len(rows)} stated defaults found: the tables or the pattern changed"
    lines = options(help_text(SERVE) or "")
    wrong = []
    for where, flag, stated in rows:
        if flag not in lines:
            wrong.append(f"{where}: {flag} ({stated}): `minfer serve --help` has no such flag")
            continue
        shown = re.search(r"default: ([^);]+)", lines[flag])
        if stated.lower() == "none" and (shown is None or shown.group(1).strip().lower() == "none"):
            continue
        if shown is None or not same(stated, shown.group(1).strip()):
            wrong.append(f"{where}: {flag}: the docs say {stated}, --help says {shown and shown.group(1)!r}")
    assert not wrong, f"{len(wrong)} default(s) the docs and --help disagree on:\n" + "\n".join(wrong)


def test_help_states_each_default_once():
    """What the docs send readers to: no option of a minfer command's --help gives two defaults (bench's used to
    say "int4 only: weights per scale (default: 64) (default: None)")."""
    twice = []
    for name in SUBCOMMANDS:
        for flag, text in options(help_text(("module", "minfer", name)) or "").items():
            if len(re.findall(r"\(default|default:", text)) > 1:
                twice.append(f"minfer {name} --help: {text.strip()}")
    assert not twice, "options whose help gives two defaults:\n" + "\n".join(twice)
