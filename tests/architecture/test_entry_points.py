"""The commands users have in their scripts keep working after the package moved into layers,
and the `minfer` command runs each of them; `python -m minfer.generate` streams what the engine generates.
Each command runs in a process of its own, forked from one that has imported torch (not minfer):
tests/script_forks.py."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from script_forks import run_python

from minfer import LLM, SamplingParams, settings

ROOT = Path(__file__).resolve().parents[2]
OLD_COMMANDS = [
    ["-m", "minfer.serve", "--help"],
    ["-m", "minfer.generate", "--help"],
    ["-m", "minfer.random_model", "--help"],
    ["-m", "minfer.stress", "--help"],
    ["bench.py", "--help"],
]


def run(argv):
    return run_python(argv, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)


@pytest.mark.parametrize("argv", OLD_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_old_entry_points_still_run(argv):
    done = run([sys.executable, *argv])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: "), done.stdout


def test_old_random_model_writes_a_checkpoint(tmp_path):
    done = run([sys.executable, "-m", "minfer.random_model", str(tmp_path / "m")])
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "m").iterdir()}


def test_package_names():
    done = run([sys.executable, "-c", "from minfer import LLM, SamplingParams, __version__; print(LLM.__name__)"])
    assert done.returncode == 0 and done.stdout.strip() == "LLM", done.stderr


def minfer_command() -> list[str]:
    """The installed console script if it is on PATH (pip install -e .), else the same code via -m."""
    script = shutil.which("minfer", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "minfer"]


def test_minfer_help_lists_every_subcommand():
    done = run([*minfer_command(), "--help"])
    assert done.returncode == 0, done.stderr
    for name in ("serve", "generate", "random-model", "stress", "bench", "eval-ppl", "train-tiny", "settings"):
        assert f"  {name} " in done.stdout, done.stdout


@pytest.mark.parametrize("name", ["serve", "generate", "random-model", "stress", "bench", "eval-ppl", "train-tiny",
                                  "settings"])
def test_minfer_subcommand_help(name):
    done = run([*minfer_command(), name, "--help"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: minfer {name} "), done.stdout


def test_minfer_subcommands_run(tmp_path):
    """random-model writes a checkpoint and generate reads it: both through the `minfer` command."""
    out = tmp_path / "tiny"
    done = run([*minfer_command(), "random-model", str(out)])
    assert done.returncode == 0 and "wrote a random tiny checkpoint" in done.stdout, done.stderr
    done = run([*minfer_command(), "generate", "--model", str(out), "--max-tokens", "4", "--temperature", "0", "hi"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("hi"), done.stdout


@pytest.mark.parametrize("command", [["settings"], None], ids=["minfer settings", "python -m minfer.settings"])
def test_minfer_settings_lists_every_variable_with_its_value(command):
    argv = [*minfer_command(), *command] if command else [sys.executable, "-m", "minfer.settings"]
    done = run_python(argv, cwd=ROOT, env={**os.environ, "MINFER_DTYPE": "bfloat16"}, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr  # nothing else: runpy's warning was
    lines = done.stdout.splitlines()
    assert [line.split("=")[0] for line in lines] == [var.name for var in settings.ALL]
    assert any(line.startswith("MINFER_DTYPE=bfloat16 ") for line in lines), done.stdout


def test_minfer_refuses_an_unknown_subcommand():
    done = run([*minfer_command(), "launch"])
    assert done.returncode == 2 and "unknown subcommand 'launch'" in done.stderr


def test_generate_cli_streams_the_engine_output(tiny_checkpoint):
    cmd = [
        sys.executable,
        "-m",
        "minfer.generate",
        "--model",
        str(tiny_checkpoint),
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "The cache",
    ]
    result = run_python(cmd, timeout=120)
    assert result.returncode == 0, result.stderr
    llm = LLM(tiny_checkpoint, num_kv_blocks=32)
    expected = llm.generate(["The cache"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    assert result.stdout == "The cache" + expected.text + "\n"


def start_generating(tiny_checkpoint) -> subprocess.Popen:
    """`python -m minfer.generate` mid-stream: its first bytes read, hundreds of tokens still to come."""
    cmd = [sys.executable, "-m", "minfer.generate", "--model", str(tiny_checkpoint), "--temperature", "0",
           "--max-tokens", "400", "Once upon a time"]
    # A test runner's workers may ignore SIGINT, and a child inherits that: Python then installs no handler.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.read(4) == b"Once"
    return proc


def test_generate_cli_stops_quietly_on_ctrl_c_and_when_its_reader_goes(tiny_checkpoint):
    proc = start_generating(tiny_checkpoint)
    proc.send_signal(signal.SIGINT)
    proc.stdout.read()
    status, stderr = proc.wait(30), proc.stderr.read()  # CI once saw -6 (SIGABRT): its stderr says why
    assert status == 130 and b"Traceback" not in stderr, (status, stderr.decode(errors="replace")[-3000:])
    proc = start_generating(tiny_checkpoint)  # `minfer generate ... | head -c 4`
    proc.stdout.close()
    status, stderr = proc.wait(30), proc.stderr.read()
    assert status == 1 and stderr == b"", (status, stderr.decode(errors="replace")[-3000:])


def test_generate_cli_names_a_prompt_that_is_not_text(tiny_checkpoint, capsys):
    from minfer.generate import main

    argv_text = b"a\xffb".decode(sys.getfilesystemencoding(), "surrogateescape")  # how Python hands argv over
    assert main(["--model", str(tiny_checkpoint), argv_text]) == 2  # a bad argument: argparse's status
    encoding = sys.getfilesystemencoding()
    assert capsys.readouterr().err == f"error: the prompt is not {encoding} text: byte 0xff does not decode\n"


@pytest.mark.parametrize("flags, message", [(["--temperature", "-1"], "temperature must be"),
                                            (["--block-size", "0"], "--block-size must be a positive integer")])
def test_generate_cli_exits_2_on_a_bad_flag_value(flags, message, capsys):
    from minfer.generate import main

    assert main(["--model", "/nonexistent", *flags, "hi"]) == 2  # judged before the model loads
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "5000", "hi"], "error: prompt (2 tokens) + max_tokens (5000) exceeds the model's context of 512"),
    (["--num-kv-blocks", "2", "hi"], "error: the request needs 3 KV blocks"),
    (["--max-model-len", "5000", "hi"], "error: --max-model-len 5000 exceeds the model's context of 512 tokens"),
])
def test_generate_cli_exits_2_when_the_request_does_not_fit(tiny_checkpoint, flags, message, capsys):
    """Judged once the model loads, the request is still the flags' mistake: one line, and a bad argument's status."""
    from minfer.generate import main

    assert main(["--model", str(tiny_checkpoint), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_generate_cli_samples_with_the_generation_config(tiny_checkpoint, tmp_path, capsys):
    """--generation-config (auto, or DIR) gives the flags left out their defaults, as it does the server's requests."""
    from minfer.generate import main

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0}')
    flags = ["--model", str(tiny_checkpoint), "--num-kv-blocks", "32", "--max-tokens", "12"]
    texts = []
    for seed in ("1", "2"):  # greedy whatever the engine's seed
        assert main([*flags, "--generation-config", str(tmp_path), "--seed", seed, "The cache"]) == 0
        texts.append(capsys.readouterr().out)
    llm = LLM(tiny_checkpoint, num_kv_blocks=32)
    greedy = llm.generate(["The cache"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    assert texts == ["The cache" + greedy.text + "\n"] * 2
    assert main([*flags, "--generation-config", str(tmp_path), "--temperature", "1", "The cache"]) == 0
    assert capsys.readouterr().out != texts[0]  # a flag given wins over the file
