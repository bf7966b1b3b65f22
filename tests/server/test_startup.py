"""What an operator sees when the server starts: a banner with every choice the engine made, and
one clean line, before the model loads, for every bad start (`python -m minfer.serve` in a fork of a
process that has imported torch: tests/script_forks.py)."""

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from script_forks import run_python

from minfer import EngineConfig
from minfer.server.serve import create_server


def serve(*argv, timeout=60):
    return run_python([sys.executable, "-m", "minfer.serve", *argv], timeout=timeout)


def test_banner_names_every_choice(tiny_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="minfer.serve"):
        srv = create_server(EngineConfig(str(tiny_checkpoint), dtype="auto", num_kv_blocks=100), port=0, api_key="k")
    threading.Thread(target=srv.serve_forever, daemon=True).start()  # stop() waits for the serving loop
    srv.stop(grace=0.5)
    text = caplog.text
    port = srv.server_address[1]
    for expected in [
        f"model: {tiny_checkpoint} (GPT2, ",
        "M parameters)",
        "dtype: ",
        "(auto: ",
        "device: cpu, ",
        " thread",
        "; attention: ",
        "idle OpenMP threads: ",
        "KV cache: 100 blocks x 16 tokens = 1,600 tokens, ",
        "MiB; prefix caching on",
        "max model len 512; max num seqs 64; max num batched tokens 512",
        f"listening on http://127.0.0.1:{port}; API key required",
    ]:
        assert expected in text, (expected, text)


def test_the_banner_counts_the_threads_the_engine_runs(tiny_checkpoint, caplog):
    """The server loads the model, setting torch's threads, on a thread of its own (OpenMP's count is per
    thread): the banner says the engine's count, not that of the thread it is written on."""
    import torch

    before = torch.get_num_threads()
    asked = 1 if before != 1 else 2
    try:
        with caplog.at_level(logging.INFO, logger="minfer.serve"):
            config = EngineConfig(str(tiny_checkpoint), num_kv_blocks=16, num_threads=asked)
            srv = create_server(config, port=0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        srv.stop(grace=0.5)
    finally:
        torch.set_num_threads(before)
    assert f"device: cpu, {asked} thread{'s' * (asked > 1)} (--num-threads, on " in caplog.text, caplog.text


@pytest.mark.parametrize("asked", [None, 1])
def test_health_reports_the_threads_the_engine_runs(tiny_checkpoint, monkeypatch, asked):
    """Chosen by the engine (no flag, no variable: one per core, or a CPU quota's) or given: /health says the
    number, not null."""
    import torch

    from minfer.cpu.threads import cpu_threads_wanted

    monkeypatch.delenv("MINFER_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=16, num_threads=asked), port=0)
        srv.manager.shutdown()
        srv.server_close()
    finally:
        torch.set_num_threads(before)
    engine = srv.health()[1]["engine"]
    assert engine["num_threads"] == (asked or cpu_threads_wanted()) >= 1, engine


def test_log_level_warning_hides_the_banner_but_not_the_serving_line(tiny_checkpoint):
    proc = subprocess.Popen(
        [sys.executable, "-m", "minfer.serve", "--model", str(tiny_checkpoint), "--port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("minfer: serving ") and "on http://127.0.0.1:" in line
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "KV cache:" not in err


def test_cuda_on_a_cpu_build_is_one_line(tiny_checkpoint):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = serve("--model", str(tiny_checkpoint), "--device", "cuda", "--port", "0")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --device cuda: this torch ({torch.__version__}) is a CPU-only build; use --device cpu"
    ] or "sees no CUDA GPU" in done.stderr


def test_port_in_use_is_named_before_the_model_loads(tiny_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.perf_counter()
        done = serve("--model", "/nonexistent/not-even-checked", "--port", str(port))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and f"port {port}" in done.stderr
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize(
    "argv, message, status",
    [
        (["--model", "/nonexistent/ckpt"], "is not a directory", 1),
        (["--model", "/tmp"], "no config.json", 1),
        # a bad flag value exits 2, as argparse's own errors do
        (["--block-size", "0"], "--block-size must be a positive integer", 2),
        (["--attention-backend", "fast"], "--attention-backend must be one of auto, compiled, eager", 2),
        (["--request-timeout", "0"], "--request-timeout must be a number of seconds > 0", 2),
        (["--max-queued", "-1"], "--max-queued must be an integer >= 0", 2),
        # bad for this model: known once its config.json is read, still a bad flag
        (["--max-model-len", "100000"], "--max-model-len 100000 exceeds the model's context of 512 tokens", 2),
        (["--num-kv-blocks", "1000000000"], "--num-kv-blocks 1000000000 is more than the", 2),
    ],
)
def test_bad_starts_are_one_line(tiny_checkpoint, argv, message, status):
    argv = argv if argv[0] == "--model" else ["--model", str(tiny_checkpoint), *argv]
    done = serve(*argv, "--port", "0")
    assert done.returncode == status and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def test_a_missing_tokenizer_is_one_line_before_the_weights_load(tiny_checkpoint, tmp_path, monkeypatch):
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for f in tiny_checkpoint.iterdir():
        if not f.name.startswith("tokenizer") and f.name not in ("vocab.json", "merges.txt"):
            (no_tokenizer / f.name).symlink_to(f)
    done = serve("--model", str(no_tokenizer), "--port", "0")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: no tokenizer found in {no_tokenizer}: looked for tokenizer.json, or vocab.json with merges.txt."
    ]
    import minfer.assembly.build as build_module

    loaded = []
    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: loaded.append(a) or pytest.fail("loaded"))
    with pytest.raises(FileNotFoundError, match="no tokenizer found"):
        create_server(EngineConfig(str(no_tokenizer)), port=0)
    assert loaded == []  # the weights were never read


@pytest.mark.parametrize("setting", [{"max_model_len": 100_000}, {"num_kv_blocks": 10**9}])
def test_a_flag_the_model_cannot_take_fails_before_the_weights_load(tiny_checkpoint, monkeypatch, setting):
    """Only config.json is needed to refuse it: a large checkpoint's minute of loading is not spent first."""
    import minfer.assembly.build as build_module
    from minfer.errors import BadSetting

    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(BadSetting, match="--max-model-len|--num-kv-blocks"):
        create_server(EngineConfig(str(tiny_checkpoint), **setting), port=0)


@pytest.mark.parametrize(
    "env, flag, expected",
    [({"OMP_NUM_THREADS": "1"}, None, 1), ({"MINFER_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"}, None, 1),
     ({"OMP_NUM_THREADS": "2"}, 1, 1)],  # fmt: skip
)
def test_thread_count_from_flag_then_environment(monkeypatch, env, flag, expected):
    import torch

    from minfer.assembly.build import set_cpu_threads

    before = torch.get_num_threads()
    for name in ("MINFER_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        assert set_cpu_threads(flag) == expected == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_more_threads_than_cores_are_warned_about(monkeypatch, caplog):
    import torch

    from minfer.assembly import build

    before = torch.get_num_threads()
    monkeypatch.setattr(build, "cores_allowed", lambda: [0, 1])
    try:
        with caplog.at_level(logging.WARNING, logger="minfer"):
            assert build.set_cpu_threads(2) == 2 and not caplog.records  # every core: nothing to say
            assert build.set_cpu_threads(3) == 3 == torch.get_num_threads()  # the user's count stands
        assert "3 threads on the 2 cores" in caplog.text and "--num-threads 2" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_openmp_binding_the_main_thread_leaves_every_core_counted():
    """Told to bind (OMP_PROC_BIND, as OMP_PLACES or GOMP_CPU_AFFINITY do), OpenMP pins the importing thread
    to one core as torch loads: minfer still counts the cores the process may use, and starts a thread on each."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("one core here: nothing for a binding to narrow")
    script = ("import os, minfer; from minfer.cpu.threads import cores_allowed, cpu_threads_wanted; "
              "print(len(os.sched_getaffinity(0)), len(cores_allowed()), cpu_threads_wanted())")
    env = {k: v for k, v in os.environ.items() if k not in ("MINFER_NUM_THREADS", "OMP_NUM_THREADS")}
    env["OMP_PROC_BIND"] = "true"
    done = subprocess.run(["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "2", "2"]  # the thread bound to one core; two counted, two threads


@pytest.mark.parametrize("variables, flag, says", [
    ({}, None, "one per core"),
    ({"OMP_NUM_THREADS": "1"}, None, "1 thread (OMP_NUM_THREADS=1, "),  # a container's setting, named
    ({"MINFER_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"}, None, "2 threads (MINFER_NUM_THREADS=2, "),
    ({"OMP_NUM_THREADS": "1"}, 2, "2 threads (--num-threads, "),
])
def test_the_banner_says_where_the_thread_count_came_from(tiny_checkpoint, monkeypatch, variables, flag, says):
    import torch

    from minfer import LLM
    from minfer.server.banner import banner_lines

    monkeypatch.delenv("MINFER_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    before = torch.get_num_threads()
    try:
        llm = LLM(tiny_checkpoint, num_kv_blocks=16, num_threads=flag)
        lines = banner_lines(llm.scheduler, "float32", "-", False)
        device_line = next(line for line in lines if line.startswith("device:"))
    finally:
        torch.set_num_threads(before)
    assert says in device_line, device_line


@pytest.mark.parametrize("variables, binds", [
    ({}, False), ({"OMP_PROC_BIND": "true"}, True), ({"OMP_PROC_BIND": "spread"}, True),
    ({"OMP_PLACES": "cores"}, True), ({"GOMP_CPU_AFFINITY": "0-1"}, True), ({"OMP_PROC_BIND": "FALSE"}, False),
    ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "false"}, False),
])
def test_a_narrower_affinity_counts_as_openmps_only_where_it_binds(monkeypatch, variables, binds):
    from minfer import settings
    from minfer.cpu import threads

    for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(settings, "CPUS_AT_IMPORT", frozenset({0, 1}))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})  # narrowed: by OpenMP, or by the user
    assert threads.openmp_binds() == binds
    assert threads.cores_allowed() == ([0, 1] if binds else [1])


def test_a_binding_before_minfer_was_imported_is_warned_about(monkeypatch, caplog):
    """torch imported first, under OMP_PROC_BIND: the thread was bound before minfer could note the CPUs."""
    import torch

    from minfer import settings
    from minfer.assembly import build

    for name in ("MINFER_NUM_THREADS", "OMP_NUM_THREADS", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    monkeypatch.setattr(settings, "CPUS_AT_IMPORT", None)  # what settings notes when torch came first
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="minfer"):
            assert build.set_cpu_threads() == 1
            assert "import minfer first, or give --num-threads" in caplog.text
            caplog.clear()
            build.set_cpu_threads(1)  # the user's count: nothing to say
            assert not caplog.records
    finally:
        torch.set_num_threads(before)


def test_a_bad_thread_variable_is_refused(monkeypatch):
    from minfer.assembly.build import set_cpu_threads

    monkeypatch.setenv("MINFER_NUM_THREADS", "lots")
    with pytest.raises(ValueError, match="MINFER_NUM_THREADS must be a positive integer, got 'lots'"):
        set_cpu_threads()


def test_one_prompt_draws_no_progress_bar(tiny_checkpoint, capsys):
    from minfer import LLM, SamplingParams

    llm = LLM(tiny_checkpoint, num_kv_blocks=16)
    llm.generate(["hi"], SamplingParams(max_tokens=3))
    assert "generate" not in capsys.readouterr().err
    llm.generate(["hi", "there"], SamplingParams(max_tokens=3))
    assert "generate" in capsys.readouterr().err  # two prompts: the bar counts requests


def test_importing_minfer_leaves_the_compiler_unloaded():
    """Importing Dynamo costs ~1.3 s, on every `minfer` command and `python -m minfer.serve --help`
    alike: only compiling loads it (compiled/attention.py and compiled/step.py import it late)."""
    code = (
        "import sys, minfer, minfer.serve, minfer.bench.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("port", ["99999", "-1", "8o"])
def test_a_port_out_of_range_is_refused_before_the_model_loads(port, capsys):
    from minfer.server.serve import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "/nonexistent", "--port", port])
    assert e.value.code == 2
    assert f"argument --port: a port must be an integer in [0, 65535], got '{port}'" in capsys.readouterr().err


def test_a_host_that_does_not_resolve_is_not_blamed_on_another_server():
    from minfer.server.serve import check_port_free

    with pytest.raises(OSError) as e:
        check_port_free("999.1.1.1", 8000)
    assert str(e.value).startswith("cannot listen on 999.1.1.1:8000: ") and "another server" not in str(e.value)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(OSError, match=r"\(is another server on port \d+\?\)"):
            check_port_free("127.0.0.1", held.getsockname()[1])


@pytest.mark.parametrize("flag", ["--api-key", "--served-model-name"])
def test_an_empty_key_or_name_is_refused_before_the_model_loads(flag, capsys):
    """An empty --api-key made every request a 401; an empty --served-model-name was served as the model's own."""
    from minfer.server.serve import main

    assert main(["--model", "/nonexistent/not-even-checked", "--port", "0", flag, " "]) == 2  # a bad argument
    assert capsys.readouterr().err.startswith(f"error: {flag} is empty: give ")


@pytest.mark.parametrize("template, message", [
    ("missing.jinja", "is neither a file nor a Jinja template"),
    (b"\xff\xfe{{ messages }}", "cannot be read as UTF-8 text"),
    ("{{ messages", "does not compile: unexpected end of template"),
])
def test_a_bad_chat_template_is_a_bad_flag_judged_before_the_model_loads(tmp_path, capsys, template, message):
    """A --chat-template file that is missing, not text, or not Jinja: exit 2 in one line naming the flag, as any
    bad flag, and before the model (here one that does not exist) is looked at."""
    from minfer.server.serve import main

    if template != "missing.jinja":
        path = tmp_path / "template.jinja"
        path.write_bytes(template if isinstance(template, bytes) else template.encode())
        template = str(path)
    assert main(["--model", "/nonexistent/not-even-checked", "--port", "0", "--chat-template", template]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --chat-template {template!r} ") and message in err and err.count("\n") == 1, err
