"""bench.py's inputs: a missing model and bad flags are one-line errors; request lengths, prompts and arrival
times; percentiles as numpy has them; a comparison that reads in one direction."""

import math
import random
import statistics

import pytest

from minfer.bench import cli as bench
from minfer.bench.metrics import percentile
from minfer.bench.workload import arrival_times, build_workload, parse_length, sampleable_token_ids
from minfer.text.tokenizer import Tokenizer


def test_without_a_model_says_how_to_get_one(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert bench.main(["--disable-tqdm"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--model DIR" in err and "python -m minfer.random_model DIR --config gpt2" in err


def test_bad_flags_are_one_line_errors(tiny_checkpoint, capsys):
    assert bench.main(["--model", str(tiny_checkpoint), "--input-len", "500", "--output-len", "100"]) == 1
    assert "context of 512" in capsys.readouterr().err
    for mode in ("offline", "online"):  # --max-model-len shortens the context: the same sentence, before any load
        assert bench.main(["--model", str(tiny_checkpoint), "--mode", mode, "--max-model-len", "32",
                           "--input-len", "30", "--output-len", "4", "--disable-tqdm"]) == 1
        err = capsys.readouterr().err
        assert err.endswith("30 prompt tokens + 4 output tokens exceed the context of 32 (--max-model-len); "
                            "lower --input-len/--output-len\n") and "loading" not in err and "starting" not in err


@pytest.mark.parametrize("flags, message", [
    (["--input-len", "9:3"], "--input-len must be >= 1 with the low end first, got '9:3'"),
    (["--output-len", "0"], "--output-len must be >= 1 with the low end first, got '0'"),
    (["--output-len", "many"], "--output-len must be a number or a range like 32:256, got 'many'"),
    (["--request-rate", "0"], "--request-rate must be > 0 (or inf), got 0"),
    (["--request-rate", "nan"], "--request-rate must be > 0 (or inf), got nan"),
])
def test_a_bad_workload_flag_is_an_argparse_error(flags, message, capsys):
    """Judged with the other flags, before anything loads: argparse's exit status 2, the flag named."""
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", "minfer-tiny", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_lengths_prompts_and_arrivals(tiny_checkpoint):
    assert parse_length("7") == (7, 7) and parse_length("32:256") == (32, 256)
    tok = Tokenizer.from_dir(tiny_checkpoint)
    assert tok.eos_token_id not in sampleable_token_ids(tok, 512)
    reqs = build_workload(
        200, "3:9", "2", texts=[], tokenizer=tok, vocab_size=512, context=512, rate=50.0, seed=1, pretok=False
    )
    assert {len(r.prompt_token_ids) for r in reqs} == set(range(3, 10))  # uniform over the whole range
    assert all(r.input_len == len(r.prompt_token_ids) and tok.eos_token_id not in r.prompt_token_ids for r in reqs)
    again = build_workload(
        200, "3:9", "2", texts=[], tokenizer=tok, vocab_size=512, context=512, rate=50.0, seed=1, pretok=False, run=1
    )
    assert [r.input_len for r in again] == [r.input_len for r in reqs]  # same shape,
    assert [r.prompt_token_ids for r in again] != [r.prompt_token_ids for r in reqs]  # fresh contents
    gaps = [b - a for a, b in zip(*[arrival_times(4000, 50.0, random.Random(0))[i:] for i in (0, 1)])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.1)  # Poisson: exponential gaps, mean 1/rate
    assert arrival_times(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 50) == 3.0 and percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 90) == pytest.approx(4.6) and percentile([7.0], 99) == 7.0


def test_comparison_reads_in_one_direction():
    """Throughput and latency ratios both say 'minfer is N x faster/slower', never a bare ratio."""
    from minfer.bench.hf_baseline import verdict

    assert verdict(200.0, 100.0, higher_is_better=True) == "minfer is 2.00x faster"
    assert verdict(50.0, 100.0, higher_is_better=True) == "minfer is 2.00x slower"
    assert verdict(10.0, 40.0, higher_is_better=False) == "minfer is 4.00x faster"  # a lower TPOT wins
    assert verdict(52.4, 10.0, higher_is_better=False) == "minfer is 5.24x slower"
    assert verdict(None, 10.0, higher_is_better=False) == "n/a"


def test_the_median_of_runs_keeps_counts_whole():
    """Two runs that completed 3 and 4 requests: a median of 3.5 requests is no count; latencies interpolate."""
    from minfer.bench.metrics import median_summary

    runs = [{"completed": 3, "failed": 1, "mean_ttft_ms": 10.0, "note": "a"},
            {"completed": 4, "failed": 0, "mean_ttft_ms": 20.0, "note": "a"}]
    median = median_summary(runs)
    assert median == {"completed": 3, "failed": 0, "mean_ttft_ms": 15.0, "note": "a"}
    assert isinstance(median["completed"], int) and isinstance(median["failed"], int)


@pytest.mark.parametrize("prog", ["python bench.py", "minfer bench"])
@pytest.mark.parametrize("flags, status", [
    (["--num-requests", "x"], 2),  # argparse's own
    (["--kv-cache-memory", "lots"], 2),  # an engine flag, judged with the others
    (["--prompts-file", "/nonexistent/prompts.txt"], 2),  # a path that names nothing: a bad flag
    (["--base-url", "http://127.0.0.1:1", "--tokenizer", "/nonexistent/ckpt"], 2),
    (["--max-model-len", "100000"], 2),  # a flag this model cannot take
    (["--model", "/nonexistent/ckpt"], 1),  # no model to load, with the advice of how to get one
    (["--base-url", "http://127.0.0.1:1", "--num-requests", "1", "--warmup-runs", "0"], 1),  # no server there
])
def test_every_error_is_one_line_that_starts_with_the_program_s_name(prog, flags, status, capsys):
    """bench.py's errors began 'python bench.py: error' (argparse's) or 'bench.py: error' (its own) by where they
    were found: one form now, argparse's `prog`, so `minfer bench` names itself too."""
    argv = flags if "--model" in flags else ["--model", "minfer-tiny", *flags]
    try:
        code = bench.main([*argv, "--disable-tqdm"], prog=prog)
    except SystemExit as e:  # argparse's errors exit
        code = e.code
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == status and last.startswith(f"{prog}: error: "), last
