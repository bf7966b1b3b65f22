"""bench.py's request features, offline and against a server in this process: --logprobs asks every request for
them, --n counts every choice, --structured-output holds every request to its schema."""

import json

import pytest
from bench_runs import WORKLOAD, run_bench
from serving import serving

from minfer import EngineConfig
from minfer.bench import cli as bench


def test_logprobs_flag_asks_every_request_for_logprobs(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """--logprobs k: offline, and online against a server in this process, every step computes them."""
    from minfer.scoring.logprobs import StepLogprobs

    fetched = []
    real_packed = StepLogprobs.packed
    monkeypatch.setattr(
        StepLogprobs, "packed", lambda self, *a: fetched.append(self.sample_k) or real_packed(self, *a)
    )
    run_bench(capsys, "--model", tiny_checkpoint, *WORKLOAD, "--logprobs", "3", "--json", tmp_path / "b.json")
    assert fetched and set(fetched) == {3}
    assert json.loads((tmp_path / "b.json").read_text())["config"]["logprobs"] == 3
    fetched.clear()
    with serving(EngineConfig(str(tiny_checkpoint)), served_model_name="tiny") as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        run_bench(
            capsys, "--base-url", url, "--model", "tiny", "--tokenizer", tiny_checkpoint, *WORKLOAD, "--logprobs", "1"
        )
    assert fetched and set(fetched) == {1}
    with pytest.raises(SystemExit):
        bench.main(["--model", str(tiny_checkpoint), "--logprobs", "21"])


def test_n_counts_every_choice_offline_and_online(tiny_checkpoint, tmp_path, capsys):
    """--n 3: each request's output_len is its three choices' tokens, its TPOT per choice; the server
    gets n and answers with usage for all three."""
    with serving(EngineConfig(str(tiny_checkpoint)), served_model_name="tiny") as server:
        online = ["--base-url", f"http://127.0.0.1:{server.server_address[1]}/v1", "--tokenizer", tiny_checkpoint]
        for mode, extra in (("offline", ["--model", tiny_checkpoint]), ("online", online)):
            path = tmp_path / f"{mode}.json"
            run_bench(capsys, *extra, *WORKLOAD, "--n", 3, "--warmup-runs", 0, "--json", path)
            report = json.loads(path.read_text())
            for r in report["requests"]:
                assert r["num_choices"] == 3 and r["output_len"] == r["expected_output_len"]
                assert r["output_len"] % 3 == 0 and 12 <= r["output_len"] <= 36
                assert r["tpot"] == pytest.approx((r["latency"] - r["ttft"]) / (r["output_len"] / 3 - 1))
            assert report["summary"]["total_output_tokens"] == sum(r["output_len"] for r in report["requests"])
    stats = server.manager.stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    with pytest.raises(SystemExit):
        bench.main(["--model", str(tiny_checkpoint), "--n", "0"])


def test_structured_output_holds_every_request_to_the_schema(tiny_checkpoint, tmp_path, capsys):
    """--structured-output json-schema: every request is masked, offline and online, and still makes exactly
    its output length (the schema's array never ends first); offline, the masks' cost per row is reported."""
    path = tmp_path / "offline.json"
    out = run_bench(capsys, "--model", tiny_checkpoint, *WORKLOAD, "--structured-output", "json-schema",
                    "--json", path)
    assert "held to a json-schema" in out and "masked rows" in out
    report = json.loads(path.read_text())
    assert all(r["output_len"] == r["expected_output_len"] for r in report["requests"])
    masks = report["structured_masks"]
    assert masks["rows"] >= report["summary"]["total_output_tokens"] and masks["fill_us_per_row"] > 0
    with serving(EngineConfig(str(tiny_checkpoint)), served_model_name="tiny") as server:
        online = ["--base-url", f"http://127.0.0.1:{server.server_address[1]}/v1", "--tokenizer", tiny_checkpoint]
        run_bench(capsys, *online, *WORKLOAD, "--structured-output", "json-schema", "--json", tmp_path / "on.json")
    report = json.loads((tmp_path / "on.json").read_text())
    assert all(r["output_len"] == r["expected_output_len"] for r in report["requests"])
    assert server.manager.scheduler.features.structured.stats["rows"] >= report["summary"]["total_output_tokens"]
