"""bench.py end to end on a tiny random checkpoint: offline and online, the JSON summary checked
against its own per-request records, the trace, the transformers baseline, the roofline and the profile.
Its inputs: test_bench_inputs.py; its request features (--logprobs, --n, --structured-output):
test_bench_requests.py."""

import itertools
import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from bench_runs import WORKLOAD, run_bench

from minfer import EngineConfig
from minfer.bench.metrics import percentile
from minfer.text.tokenizer import Tokenizer


def check_summary(summary, records, exact_itl_count):
    """Recompute the summary from the per-request records."""
    assert summary["completed"] == len(records) and summary["failed"] == 0 and summary["cut_short"] == 0
    for r in records:
        assert 4 <= r["expected_output_len"] <= 12 and 8 <= r["input_len"] <= 24
        assert r["output_len"] == r["expected_output_len"]  # ignore_eos: exactly the asked length
        assert r["ttft"] == pytest.approx(r["first_token_time"] - r["submit_time"])
        assert r["tpot"] == pytest.approx((r["latency"] - r["ttft"]) / (r["output_len"] - 1))
        if exact_itl_count:  # offline every token is timed; online only chunks that carry text
            assert len(r["itl"]) == r["output_len"] - 1
    ttfts = [r["ttft"] * 1000 for r in records]
    assert summary["mean_ttft_ms"] == pytest.approx(statistics.fmean(ttfts))
    assert summary["median_ttft_ms"] == pytest.approx(statistics.median(ttfts))
    assert summary["p99_ttft_ms"] == pytest.approx(percentile(ttfts, 99))
    assert min(ttfts) <= summary["p90_ttft_ms"] <= max(ttfts)
    assert summary["mean_tpot_ms"] == pytest.approx(statistics.fmean(r["tpot"] * 1000 for r in records))
    itls = [g * 1000 for r in records for g in r["itl"]]
    assert summary["median_itl_ms"] == pytest.approx(statistics.median(itls))
    assert summary["mean_e2el_ms"] == pytest.approx(statistics.fmean(r["latency"] * 1000 for r in records))
    out = sum(r["output_len"] for r in records)
    assert summary["total_output_tokens"] == out
    assert summary["total_input_tokens"] == sum(r["input_len"] for r in records)
    assert summary["output_throughput"] == pytest.approx(out / summary["duration"])
    assert summary["request_throughput"] == pytest.approx(len(records) / summary["duration"])
    assert max(r["finish_time"] for r in records) <= summary["duration"]


def check_table(out, mode="offline"):
    """The header echoes the configuration before the figures; the title and memory name the mode."""
    header = out[: out.index("Benchmark Result")]
    for field in ("model:", "mode:", "device:", "dtype:", "threads:", "attention:", "workload:", "arrivals:"):
        assert field in header
    assert f"mode:      {mode}" in header
    title = "Serving Benchmark Result (online)" if mode == "online" else "Offline Benchmark Result"
    assert title in out
    assert ("Memory (the minfer server process)" if mode == "online" else "Memory (this process") in out
    for line in [
        "Benchmark Result",
        "Successful requests:",
        "Benchmark duration (s):",
        "Output token throughput (tok/s):",
        "Total Token throughput (tok/s):",
        "Mean TTFT (ms):",
        "P99 TPOT (ms):",
        "Median ITL (ms):",
        "P90 E2EL (ms):",
        "Peak RSS (MiB):",
    ]:
        assert line in out


def spans(trace, name):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == name]


# ---- end to end ------------------------------------------------------------------------


def test_offline_rate_concurrency_repeats_json_trace(tiny_checkpoint, tmp_path, capsys):
    out = run_bench(
        capsys,
        "--model",
        tiny_checkpoint,
        *WORKLOAD,
        "--request-rate",
        "300",
        "--max-concurrency",
        "3",
        "--repeat-runs",
        "2",
        "--json",
        tmp_path / "b.json",
        "--trace",
        tmp_path / "t.json",
    )
    check_table(out)
    assert "median of 2 runs" in out and "run 1:" in out
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["config"]["mode"] == "offline" and len(report["runs"]) == 2
    for k, summary in enumerate(report["runs"]):
        records = [r for r in report["requests"] if r["run"] == k]
        check_summary(summary, records, exact_itl_count=True)
        # The concurrency cap holds: never more than 3 requests between submit and finish.
        edges = sorted([(r["submit_time"], 1) for r in records] + [(r["finish_time"], -1) for r in records])
        assert max(itertools.accumulate(d for _, d in edges)) <= 3
        assert all(r["submit_time"] <= r["scheduled_time"] <= r["first_token_time"] for r in records)
    medians = statistics.median(s["mean_ttft_ms"] for s in report["runs"])
    assert report["summary"]["mean_ttft_ms"] == pytest.approx(medians)
    assert report["runs"][0]["total_output_tokens"] == report["runs"][1]["total_output_tokens"]  # same lengths

    trace = json.loads((tmp_path / "t.json").read_text())  # the last run
    last = [r for r in report["requests"] if r["run"] == 1]
    for name in ("queued", "prefill", "decode"):
        assert sorted(e["tid"] for e in spans(trace, name)) == [r["index"] + 1 for r in last]
    decode = {e["tid"]: e for e in spans(trace, "decode")}
    for r in last:
        assert decode[r["index"] + 1]["ts"] == pytest.approx(r["first_token_time"] * 1e6, abs=1)
        assert decode[r["index"] + 1]["args"]["output_len"] == r["output_len"]
    steps = spans(trace, "step")
    decoded = sum(e["args"]["num_decode_tokens"] for e in steps)
    assert steps and decoded == sum(r["output_len"] - 1 for r in last)  # one decode per token after the first
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"batch size", "tokens", "kv blocks in use", "preemptions"}
    assert max(e["args"]["seqs"] for e in counters if e["name"] == "batch size") <= 3
    assert sum(e["args"]["prefill"] for e in counters if e["name"] == "tokens") >= sum(r["input_len"] for r in last)


def test_offline_text_prompts_pretok(tiny_checkpoint, tmp_path, capsys):
    texts = ["The quick brown fox", "Hello, my name is"]
    (tmp_path / "prompts.txt").write_text("\n".join(texts) + "\n\n")
    for pretok in ([], ["--pretok"]):
        run_bench(
            capsys,
            "--model",
            tiny_checkpoint,
            "--prompts-file",
            tmp_path / "prompts.txt",
            *pretok,
            "--num-requests",
            "3",
            "--output-len",
            "5",
            "--warmup-runs",
            "0",
            "--disable-tqdm",
            "--json",
            tmp_path / "b.json",
        )
        records = json.loads((tmp_path / "b.json").read_text())["requests"]
        tok = Tokenizer.from_dir(tiny_checkpoint)
        assert [r["input_len"] for r in records] == [len(tok.encode(texts[i % 2])) for i in range(3)]
        assert [r["output_len"] for r in records] == [5, 5, 5]


def test_online_starts_minfer_serve(tiny_checkpoint, tmp_path, capsys):
    out = run_bench(
        capsys,
        "--mode",
        "online",
        "--model",
        tiny_checkpoint,
        *WORKLOAD,
        "--request-rate",
        "100",
        "--json",
        tmp_path / "b.json",
        "--trace",
        tmp_path / "t.json",
    )
    check_table(out, "online")
    report = json.loads((tmp_path / "b.json").read_text())
    check_summary(report["summary"], report["requests"], exact_itl_count=False)
    assert report["summary"]["peak_rss_mib"] > 0  # the server's
    trace = json.loads((tmp_path / "t.json").read_text())
    assert len(spans(trace, "queued+prefill")) == len(spans(trace, "decode")) == 6
    steps = spans(trace, "step")  # from the server's /engine/events
    assert sum(e["args"]["num_decode_tokens"] for e in steps) == sum(r["output_len"] - 1 for r in report["requests"])
    assert max(e["args"]["kv_blocks_used"] for e in steps) > 0


def test_online_base_url(tiny_checkpoint, tmp_path, capsys):
    """Any OpenAI-compatible server, here minfer's run in this process; the name comes from /v1/models."""
    serve = pytest.importorskip("minfer.serve")
    server = serve.create_server(EngineConfig(str(tiny_checkpoint)), port=0, served_model_name="tiny")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host, port = server.server_address[:2]
        out = run_bench(
            capsys,
            "--base-url",
            f"http://{host}:{port}/v1",
            "--model",
            "whatever",
            "--tokenizer",
            tiny_checkpoint,
            *WORKLOAD,
            "--max-concurrency",
            "2",
            "--warmup-runs",
            "0",
            "--json",
            tmp_path / "b.json",
        )
    finally:
        server.stop()
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["config"]["mode"] == "online"
    assert "device:    the server's" in out and report["config"]["machine"] is None  # not ours
    check_summary(report["summary"], report["requests"], exact_itl_count=False)
    edges = sorted(
        [(r["submit_time"], 1) for r in report["requests"]] + [(r["finish_time"], -1) for r in report["requests"]]
    )
    assert max(itertools.accumulate(d for _, d in edges)) <= 2
    assert "peak_rss_mib" not in report["summary"]  # someone else's process: not ours to report


def test_baseline_hf_and_roofline(tiny_checkpoint, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = run_bench(
        capsys,
        "--model",
        tiny_checkpoint,
        *WORKLOAD,
        "--baseline",
        "hf",
        "--hf-batch-size",
        "4",
        "--roofline",
        "--json",
        tmp_path / "b.json",
    )
    assert "transformers generate, batch 4" in out and "minfer vs transformers (batch 4)" in out and "minfer is " in out
    assert "Decode roofline (batch 1)" in out
    report = json.loads((tmp_path / "b.json").read_text())
    base = report["baseline"]
    check_summary(base["summary"], base["requests"], exact_itl_count=True)
    assert [r["output_len"] for r in base["requests"]] == [r["output_len"] for r in report["requests"]]
    # Requests 0-3 form the first static batch, 4-5 the second: a batch shares its first-token time.
    firsts = [r["first_token_time"] for r in base["requests"]]
    assert len(set(firsts[:4])) == 1 and len(set(firsts[4:])) == 1 and firsts[4] > firsts[0]
    minfer, hf, ratio = report["summary"], base["summary"], base["minfer_over_hf"]
    assert ratio["output_throughput"] == pytest.approx(minfer["output_throughput"] / hf["output_throughput"])
    assert ratio["mean_tpot_ms"] == pytest.approx(minfer["mean_tpot_ms"] / hf["mean_tpot_ms"])

    roof = report["roofline"]
    C, V, P, L = 64, 512, 512, 2  # the tiny preset; the tied LM head counted once
    params = V * C + P * C + L * (4 * C + 3 * C * C + 3 * C + C * C + C + 4 * C * C + 4 * C + 4 * C * C + C) + 2 * C
    assert roof["weight_bytes"] == params * 4 and roof["dtype"] == "float32"
    assert roof["bandwidth_gb_s"] > 0.1
    assert roof["floor_tpot_ms"] == pytest.approx(roof["weight_bytes"] / (roof["bandwidth_gb_s"] * 1e9) * 1e3)
    assert roof["measured_over_floor"] == pytest.approx(roof["measured_tpot_ms"] / roof["floor_tpot_ms"])
    assert roof["matmul_floor_ms"] > 0  # the weight matmuls alone, timed


def test_baseline_on_the_first_requests_only(tiny_checkpoint, tmp_path, capsys):
    """--hf-num-requests: a slow baseline runs a subset of a big workload (a GPU run's, say)."""
    pytest.importorskip("transformers")
    args = ("--model", tiny_checkpoint, *WORKLOAD, "--baseline", "hf", "--hf-batch-size", "2")
    out = run_bench(capsys, *args, "--hf-num-requests", "3", "--json", tmp_path / "b.json")
    assert "transformers generate, batch 2, its first 3 requests" in out
    report = json.loads((tmp_path / "b.json").read_text())
    base = report["baseline"]
    assert base["num_requests"] == 3 and len(base["requests"]) == 3 < len(report["requests"])
    assert [r["output_len"] for r in base["requests"]] == [r["output_len"] for r in report["requests"][:3]]
    with pytest.raises(SystemExit):
        run_bench(capsys, *args, "--hf-num-requests", "0")
    assert "--hf-num-requests must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_splits_a_step_into_parts(tiny_checkpoint, tmp_path, capsys, dtype):
    out = run_bench(
        capsys,
        "--model",
        tiny_checkpoint,
        "--num-requests",
        "6",
        "--input-len",
        "40",
        "--output-len",
        "24",
        "--disable-tqdm",
        "--dtype",
        dtype,
        "--profile",
        "--json",
        tmp_path / "p.json",
    )
    assert f"Step-time breakdown ({dtype})" in out
    table = [line for line in out.splitlines() if line.startswith("part ") or line[:1].isalpha() and "%" in line]
    assert len({line.index("%") for line in table if "%" in line}) == 1, table  # one column, the longest name too
    prof = json.loads((tmp_path / "p.json").read_text())["profile"]
    assert prof["peaks"]["read_gb_s"] > 0 and prof["peaks"]["matmul_gflop_s"] > 0
    prefill, decode = prof["phases"]["prefill"], prof["phases"]["decode"]
    assert prefill["prefill_tokens"] > 0 and decode["prefill_tokens"] == 0 and decode["decode_tokens"] == 6
    C, V, L, elem = 64, 512, 2, 4 if dtype == "float32" else 2
    for phase in (prefill, decode):
        rows = {r["part"]: r for r in phase["rows"]}
        assert set(rows) == {
            "host: schedule",
            "host: prepare",
            "KV write",
            "context read",
            "attention",
            "linears",
            "LM head",
            "sampling",
            "host: bookkeeping",
            "norms, GELU, residuals, Python",
        }  # no speculation in this run: no rows of its parts
        # Every part ran and the parts add up to the step: nothing counted twice.
        unused = ("context read",)
        assert all(r["ms_per_step"] > 0 for name, r in rows.items() if name not in unused)
        assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0, abs=0.02)
        assert rows["linears"]["mb_per_step"] == pytest.approx(L * 12 * C * C * elem / 1e6)  # weights once a step
        assert rows["LM head"]["mb_per_step"] == pytest.approx(V * C * elem / 1e6)
    rows = {r["part"]: r for r in decode["rows"]}
    # Six sequences decode at context 41..64: every token's K/V (2 x layers x C) read from the cache.
    assert rows["context read"]["ms_per_step"] > 0
    per_token = 2 * L * C * elem
    assert rows["context read"]["mb_per_step"] == pytest.approx(decode["context_tokens"] * per_token / 1e6)
    assert 6 * 41 <= decode["context_tokens"] <= 6 * 64
    assert rows["KV write"]["mb_per_step"] == pytest.approx(6 * per_token / 1e6)


def test_online_with_no_server_there_says_why(capsys):
    """Every request failing is one line naming the first failure, exit 1: not a table of n/a. A served
    minfer-tiny's tokenizer is the shipped one (its name is no directory)."""
    from minfer.bench.cli import main

    argv = ["--base-url", "http://127.0.0.1:1", "--model", "minfer-tiny", "--num-requests", "2", "--disable-tqdm"]
    for warmup in ("1", "0"):
        assert main([*argv, "--warmup-runs", warmup]) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == "python bench.py: error: every request to 127.0.0.1:1 failed, the first with " \
                      "ConnectionRefusedError: [Errno 111] Connection refused"


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer", "/x"], "--tokenizer applies only with --base-url"),
    (["--server-args=--max-queued 3"], "--server-args applies only when bench starts a server (--mode online)"),
    (["--base-url", "http://127.0.0.1:1", "--server-args=--max-queued 3"], "--server-args applies only when bench"),
    (["--hf-batch-size", "2"], "--hf-batch-size applies only with --baseline"),
    (["--hf-num-requests", "2"], "--hf-num-requests applies only with --baseline"),
    (["--pretok"], "--pretok applies only to text prompts (--prompt, --prompts-file, --workload copy)"),
    (["--prompt", "Hi", "--input-len", "64"], "--input-len applies only to random prompts"),
    (["--workload", "copy", "--input-len", "8:16"], "--input-len applies only to random prompts"),
    (["--block-size", "0"], "--block-size must be a positive integer"),  # the engine's flags, as argparse's
    (["--baseline", "hf", "--n", "2"], "compare with --n 1"),
    # Written at the end: a path that cannot be would lose a whole run's figures.
    (["--json", "/nonexistent-dir/b.json"], "--json /nonexistent-dir/b.json: no directory /nonexistent-dir"),
    (["--trace", "/nonexistent-dir/t.json"], "--trace /nonexistent-dir/t.json: no directory /nonexistent-dir"),
    (["--json", "."], "--json .: a directory, not a file"),
    # Another server runs with its own settings: an engine flag would change nothing measured.
    (["--base-url", "http://127.0.0.1:1", "--dtype", "bfloat16"], "--dtype applies only to an engine bench runs"),
    (["--base-url", "http://127.0.0.1:1", "--no-enable-prefix-caching"], "--no-enable-prefix-caching applies only"),
    (["--base-url", "http://127.0.0.1:1", "--max-num-seqs", "1"], "--max-num-seqs applies only to an engine"),
    # A URL that names no server: refused before anything loads, as a bad flag.
    (["--base-url", "ftp://host:8000"], "--base-url must look like http://HOST:PORT, got 'ftp://host:8000'"),
    (["--base-url", "http://127.0.0.1:99999"], "--base-url must look like http://HOST:PORT, got 'http://127.0.0.1:9999"),
    (["--base-url", "http://host:port"], "--base-url must look like http://HOST:PORT, got 'http://host:port'"),
])
def test_a_flag_the_run_would_not_apply_is_refused(flags, message, capsys):
    from minfer.bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "minfer-tiny", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_copy_workload_is_text_prompts(capsys):
    """--workload copy sends held-out stories: --pretok applies to them, and the header does not say random tokens."""
    from minfer.bench.cli import main

    assert main(["--model", "minfer-tiny", "--workload", "copy", "--pretok", "--num-requests", "2", "--output-len", "2",
                 "--warmup-runs", "0", "--disable-tqdm"]) == 0
    workload = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("workload:"))
    assert "random" not in workload and "held-out stories" in workload


def test_a_prompts_file_that_is_not_utf8_is_named(tmp_path, capsys):
    from minfer.bench.cli import main

    (tmp_path / "p.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    assert main(["--model", "minfer-tiny", "--prompts-file", str(tmp_path / "p.txt"), "--disable-tqdm"]) == 2
    assert f"prompts file {str(tmp_path / 'p.txt')!r} is not UTF-8 text: byte 0xe9 at offset 3" in capsys.readouterr().err


def test_a_reader_that_goes_ends_the_run_quietly(tiny_checkpoint):
    """`python bench.py ... | head -1`: the report's reader is gone, and bench stops without an error line."""
    proc = subprocess.Popen([sys.executable, "bench.py", "--model", str(tiny_checkpoint), *WORKLOAD],
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()  # the header's first line, then the reader goes
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 1 and "error" not in err and "Traceback" not in err, err


def test_offline_requests_take_the_checkpoint_defaults_as_served_ones_do(tiny_checkpoint, tmp_path, monkeypatch,
                                                                         capsys):
    """Online, the server fills the fields bench's requests leave out from generation_config.json
    (--generation-config); offline runs fill them the same way, under the fields the workload sets."""
    from minfer.engine.scheduler import OnlineScheduler

    (tmp_path / "generation_config.json").write_text('{"top_k": 3, "temperature": 0.7, "repetition_penalty": 1.1}')
    sent = []
    add_request = OnlineScheduler.add_request
    monkeypatch.setattr(OnlineScheduler, "add_request",
                        lambda self, *a, sampling_params, **k: sent.append(sampling_params) or add_request(
                            self, *a, sampling_params=sampling_params, **k))
    run_bench(capsys, "--model", tiny_checkpoint, *WORKLOAD, "--n", "2", "--generation-config", tmp_path)
    measured = [p for p in sent if p.n == 2]  # the warm-up's are greedy, one choice each
    assert measured and all((p.top_k, p.repetition_penalty, p.temperature) == (3, 1.1, 1.0) for p in measured)
    assert all((p.top_k, p.repetition_penalty) == (3, 1.1) for p in sent)
    sent.clear()
    run_bench(capsys, "--model", tiny_checkpoint, *WORKLOAD, "--generation-config", "vllm")
    assert sent and all((p.top_k, p.repetition_penalty, p.temperature) == (0, 1.0, 0.0) for p in sent)
