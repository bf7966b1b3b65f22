"""vLLM's serve options beyond the engine's: --generation-config, --chat-template and
--disable-log-requests, each applied, shown in the banner, and refused clearly when bad."""

import json
import logging
import shutil
import sys
import threading
import urllib.request

import pytest
from script_forks import run_python

from minfer import EngineConfig
from minfer.engine.generation_defaults import sampling_defaults
from minfer.server.chat_requests import parse_chat
from minfer.server.requests import ModelInfo, parse_completion
from minfer.server.serve import create_server
from minfer.text.tokenizer import Tokenizer


@pytest.fixture()
def tuned_checkpoint(tiny_checkpoint, tmp_path):
    """The tiny checkpoint whose author recommends greedy decoding, top_k 5 and a penalty."""
    ckpt = tmp_path / "tuned"
    shutil.copytree(tiny_checkpoint, ckpt)
    path = ckpt / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(temperature=0.0, top_k=5, repetition_penalty=1.1, max_new_tokens=50)
    path.write_text(json.dumps(config))
    return ckpt


def started(config: EngineConfig, **options):
    srv = create_server(config, port=0, **options)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def post(srv, path: str, body: dict) -> dict:
    url = "http://127.0.0.1:{}{}".format(srv.server_address[1], path)
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_generation_config_fills_only_what_the_request_leaves_out(tuned_checkpoint):
    defaults, notes = sampling_defaults(tuned_checkpoint)
    assert defaults == {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.1}
    assert notes == ["max_new_tokens=50 (not supported yet)"]  # reported, not silently dropped
    assert sampling_defaults(tuned_checkpoint, "vllm") == ({}, [])
    assert sampling_defaults(tuned_checkpoint.parent, str(tuned_checkpoint))[0] == defaults  # DIR reads that one
    info = ModelInfo("m", Tokenizer.from_dir(tuned_checkpoint), 512, sampling_defaults=defaults)
    params = parse_completion({"prompt": "Hello"}, info).params
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 5, 1.1)
    params = parse_completion({"prompt": "Hello", "temperature": 0.7, "top_k": -1}, info).params
    assert (params.temperature, params.top_k) == (0.7, 0)  # what the request sends wins
    # null is JSON's "the default": the checkpoint's, as in vLLM (it was the API's: temperature 1, sampling)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": None, "top_k": None}
    completion = {"prompt": "Hello", "temperature": None, "top_k": None}
    for parse, body in ((parse_completion, completion), (parse_chat, chat)):
        params = parse(body, info).params
        assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 5, 1.1)


def test_llm_generate_without_params_uses_the_checkpoints_defaults(tuned_checkpoint):
    """As vLLM's LLM: generate() given no SamplingParams samples with generation_config.json's settings."""
    from minfer import LLM, SamplingParams

    llm = LLM(str(tuned_checkpoint), num_kv_blocks=64)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 5, 1.1)
    tuned = SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.1)
    assert llm.generate(["Hello"])[0].token_ids == llm.generate(["Hello"], tuned)[0].token_ids
    plain = LLM(str(tuned_checkpoint), num_kv_blocks=64, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.repetition_penalty) == (1.0, 0, 1.0)


def test_a_generation_config_directory_must_exist(tmp_path):
    with pytest.raises(ValueError, match="--generation-config must be auto, vllm or a directory"):
        EngineConfig("m", generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no generation_config.json in that directory"):
        sampling_defaults("unused", str(tmp_path))


@pytest.mark.parametrize(
    "content, message",
    [
        ({"temperature": "hot"}, "temperature must be a number >= 0, got 'hot'"),
        ({"top_p": 0, "temperature": 0.7}, "top_p must be a number in (0, 1], got 0"),
        ({"top_k": -5}, "top_k must be an int >= 0 (or -1, off as 0 is), got -5"),
        ([{"temperature": 0.7}], "must hold a JSON object"),
    ],
)
def test_a_bad_generation_config_is_refused_before_the_weights_load(
    tiny_checkpoint, tmp_path, monkeypatch, content, message
):
    """Its values default every request's fields: a bad one would make each request that leaves the field out a 400
    about a field it never sent. It is the checkpoint's mistake, named at start-up with the way around it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(ValueError) as info:
        sampling_defaults(ckpt)
    said = str(info.value)
    assert said.startswith(str(ckpt / "generation_config.json")) and message in said, said
    assert "--generation-config vllm" in said and "\n" not in said
    if isinstance(content, dict):
        assert sampling_defaults(ckpt, "vllm") == ({}, [])  # the way around it
    import minfer.assembly.build as build_module

    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(ValueError, match="generation_config.json"):
        create_server(EngineConfig(str(ckpt)), port=0)


@pytest.mark.parametrize("setting", ["auto", "vllm"])
def test_served_defaults_and_their_banner_line(tuned_checkpoint, caplog, setting):
    with caplog.at_level(logging.INFO, logger="minfer.serve"):
        srv = started(EngineConfig(str(tuned_checkpoint), num_kv_blocks=64, generation_config=setting))
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
        texts = {post(srv, "/v1/completions", {**body, "seed": seed})["choices"][0]["text"] for seed in range(4)}
    finally:
        srv.stop(grace=0.5)
    if setting == "auto":
        assert len(texts) == 1  # the checkpoint's temperature 0: greedy, whatever the seed
        assert "generation_config.json: temperature=0.0, top_k=5, repetition_penalty=1.1; " in caplog.text
        assert "not applied: max_new_tokens=50 (not supported yet)" in caplog.text
    else:
        assert len(texts) > 1  # the API's temperature 1.0: four seeds, several texts
        assert "sampling defaults: the API's (--generation-config vllm)" in caplog.text


def test_chat_template_option_replaces_the_checkpoints(tiny_checkpoint, tmp_path, caplog):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    tok = Tokenizer.from_dir(tiny_checkpoint)
    for option in (template, str(tmp_path / "t.jinja")):
        with caplog.at_level(logging.INFO, logger="minfer.serve"):
            srv = started(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64), chat_template=option)
        try:
            out = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 1})
        finally:
            srv.stop(grace=0.5)
        assert out["usage"]["prompt_tokens"] == len(tok.encode("<<abc>>"))
        assert "chat template: --chat-template" in caplog.text


def test_a_bad_chat_template_fails_before_loading(tmp_path):
    done = run_python(  # in a fork of a process that has imported torch
        [sys.executable, "-m", "minfer.serve", "--model", str(tmp_path / "never-loaded"), "--port", "0",
         "--chat-template", "missing.jinja"],
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --chat-template 'missing.jinja' is neither a file nor a Jinja template (no {{ or {% in it)"
    ]


@pytest.mark.parametrize("log_requests", [True, False])
def test_disable_log_requests(tiny_checkpoint, caplog, log_requests):
    with caplog.at_level(logging.INFO, logger="minfer.serve"):
        srv = started(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64), log_requests=log_requests)
        try:
            post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        finally:
            srv.stop(grace=0.5)
    assert ('"POST /v1/completions" 200' in caplog.text) == log_requests
    assert "listening on http://127.0.0.1:" in caplog.text  # the banner logs either way


def test_llm_names_the_generation_config_keys_it_does_not_apply(tuned_checkpoint, caplog):
    """LLM, as the server's banner, says which generation_config.json keys its default params leave out."""
    from minfer import LLM

    with caplog.at_level(logging.WARNING, logger="minfer"):
        LLM(str(tuned_checkpoint), num_kv_blocks=64)
    assert "not applied: max_new_tokens=50 (not supported yet)" in caplog.text
