"""Structured outputs in the engine (minfer/structured/): a JSON schema, regex, choice or grammar held as a
token mask in the batched sampler, composed with everything else a step does.

The acceptance run: on random GPT-2, Qwen3 and Llama checkpoints and on minfer-tiny, 23 constraints, each
greedy and sampled with n = 3, batched with unconstrained requests in a cache small enough to preempt:
every output that finishes with "stop" meets its constraint, at least 90% do finish so, and the same
requests without the constraint meet none: the mask did the work."""

import json
import logging
import subprocess
import sys

import pytest
import torch
from structured_constraints import CONSTRAINTS, meets
from engine_checks import assert_all_free

from minfer import LLM, SamplingParams
from minfer.engine.structured_outputs_params import StructuredOutputsParams
from minfer.errors import InvalidParameter
from minfer.structured import grammars as grammars_module
from minfer.structured.grammars import Grammars
from minfer.structured.masks import unpack
from minfer.structured.structured import DEAD_END, Structured
from minfer.text.tokenizer import Tokenizer

PROMPTS = ["Once upon a time", "The answer is", "Lily saw a", "Here is the data:"]


def constrained(spec: dict, **params) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(**spec), **params)


@pytest.fixture(scope="module", params=["tiny", "qwen3-tiny", "llama-tiny", "minfer-tiny"])
def checkpoint(request, make_checkpoint):
    return "minfer-tiny" if request.param == "minfer-tiny" else str(make_checkpoint(request.param))


def test_every_constrained_output_that_stops_validates(checkpoint):
    llm = LLM(checkpoint, num_kv_blocks=48, max_num_seqs=24, max_num_batched_tokens=128)
    prompts, params, specs = [], [], []
    for i, (spec, _) in enumerate(CONSTRAINTS):
        prompt = PROMPTS[i % len(PROMPTS)]
        greedy = constrained(spec, max_tokens=160, temperature=0)
        sampled = constrained(spec, max_tokens=160, temperature=0.9, top_p=0.95, seed=i, n=3)
        plain = SamplingParams(max_tokens=24, temperature=0.8, seed=100 + i, ignore_eos=True)  # unconstrained beside
        prompts += [prompt] * 3
        params += [greedy, sampled, plain]
        specs += [spec] * 4 + [None]  # greedy, then the n = 3 request's three outputs, then the plain one
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0  # recomputed sequences kept their matchers' state
    checked = [(spec, out) for spec, out in zip(specs, outs) if spec is not None]
    assert len(checked) == 4 * len(CONSTRAINTS) and len(CONSTRAINTS) >= 20
    stopped = [(spec, out) for spec, out in checked if out.finish_reason == "stop"]
    wrong = [(spec, out.text) for spec, out in stopped if not meets(spec, out.text)]
    assert not wrong, wrong
    assert len(stopped) >= 0.9 * len(checked), [(s, o.text) for s, o in checked if o.finish_reason != "stop"]
    assert all(len(out.token_ids) == 24 for spec, out in zip(specs, outs) if spec is None)
    assert_all_free(llm)
    # The same greedy requests without their constraint: none meets it.
    free = llm.generate(prompts[::3], [SamplingParams(max_tokens=40, temperature=0)] * len(CONSTRAINTS), use_tqdm=False)
    assert not [out.text for (spec, _), out in zip(CONSTRAINTS, free) if meets(spec, out.text)]


def test_constrained_greedy_output_is_the_same_alone_batched_preempted_and_cached(tiny_checkpoint):
    """A matcher follows the tokens a sequence was given: recomputing after a preemption, a prefix-cache hit,
    or neighbours in the batch change nothing."""
    spec = CONSTRAINTS[1][0]
    params = constrained(spec, max_tokens=120, temperature=0)
    seeded = constrained(spec, max_tokens=120, temperature=0.9, seed=5)
    llm = LLM(tiny_checkpoint, num_kv_blocks=16, max_num_seqs=8)
    alone = llm.generate(["Once upon a time"], [params], use_tqdm=False)[0]
    alone_seeded = llm.generate(["Once upon a time"], [seeded], use_tqdm=False)[0]
    cached = llm.generate(["Once upon a time"], [params], use_tqdm=False)[0]
    assert cached.num_cached_tokens == 0 or cached.token_ids == alone.token_ids
    noise = [SamplingParams(max_tokens=100, temperature=1.0, seed=s, ignore_eos=True) for s in range(6)]
    outs = llm.generate(["Once upon a time"] * 8, [params, seeded, *noise], use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    assert outs[0].token_ids == alone.token_ids and outs[1].token_ids == alone_seeded.token_ids
    assert alone.finish_reason == "stop" and meets(spec, alone.text)
    assert_all_free(llm)


def test_prefix_cache_hits_keep_the_constraint(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    prompt = "Once upon a time " * 8  # two full blocks to hit
    params = constrained({"regex": r"[0-9]{3}-[a-z]{3}"}, max_tokens=20, temperature=0)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens > 0 and second.token_ids == first.token_ids
    assert first.finish_reason == "stop" and meets({"regex": r"[0-9]{3}-[a-z]{3}"}, first.text)


def test_logprobs_stay_the_raw_models(tiny_checkpoint):
    """As vLLM's: the logprobs come from the model's own distribution, before the mask."""
    llm = LLM(tiny_checkpoint)
    spec = {"choice": ["zebra", "yak"]}
    masked = llm.generate(["Once"], constrained(spec, max_tokens=8, temperature=0, logprobs=5), use_tqdm=False)[0]
    raw = llm.generate(["Once"], SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False)[0]
    assert masked.text in spec["choice"] and masked.token_ids[0] != raw.token_ids[0]
    first, raw_first = masked.logprobs[0], raw.logprobs[0]
    assert first.top == raw_first.top  # the same five likeliest tokens, with the same values
    assert first.logprob < raw_first.logprob  # the token the mask forced was not the model's favourite


def test_n_choices_each_follow_their_own_grammar(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    spec = {"regex": r"[a-z]{1,6}[0-9]"}
    outs = llm.generate(["Once"], constrained(spec, max_tokens=20, temperature=1.0, seed=3, n=4), use_tqdm=False)
    assert len(outs) == 4 and len({o.text for o in outs}) > 1
    assert all(o.finish_reason == "stop" and meets(spec, o.text) for o in outs)


def test_a_completed_grammar_ends_the_request_despite_ignore_eos_and_min_tokens(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    spec = {"choice": ["yes", "no"]}
    outs = llm.generate(["Once"] * 2, [constrained(spec, max_tokens=30, ignore_eos=True, temperature=0),
                                       constrained(spec, max_tokens=30, min_tokens=20, temperature=0.8, seed=1)],
                        use_tqdm=False)
    assert all(o.finish_reason == "stop" and o.text in spec["choice"] and len(o.token_ids) < 20 for o in outs)
    assert_all_free(llm)


def test_stop_strings_and_max_tokens_compose(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    cut = llm.generate(["Once"], constrained({"choice": ["red fox", "blue cat"]}, max_tokens=20, temperature=0,
                                             stop=[" "]), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.text in ("red", "blue")
    spec = {"json": {"type": "object", "properties": {"s": {"type": "string", "minLength": 50}}, "required": ["s"]}}
    long = llm.generate(["Once"], constrained(spec, max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 6 and long.text.startswith("{")


def test_a_stop_token_the_grammar_does_not_know_ends_the_reply_where_the_grammar_may_end(tiny_checkpoint):
    """llguidance knows the checkpoint's EOS alone: a request's other stop token (a chat template's end of turn
    the checkpoint does not list as EOS, say) is allowed where the grammar may end, and ends the reply with
    "stop", as it does unconstrained; masked, the reply ran to max_tokens."""
    llm = LLM(tiny_checkpoint)
    bang = llm.tokenizer.encode("!")[-1]  # "!": no text the regex allows
    bias = {bang: 100, **{e: -100 for e in llm.tokenizer.eos_token_ids}}
    params = [constrained({"regex": "[a-z ]{0,60}"}, stop_token_ids=[bang], logit_bias=bias, max_tokens=8,
                          temperature=0),
              SamplingParams(stop_token_ids=[bang], logit_bias=bias, max_tokens=8, temperature=0)]
    outs = llm.generate(["Once"] * 2, params, use_tqdm=False)
    assert [(o.finish_reason, o.token_ids) for o in outs] == [("stop", [bang])] * 2
    held = constrained({"regex": "[a-z]{3}"}, stop_token_ids=[bang], logit_bias=bias, max_tokens=8, temperature=0)
    out = llm.generate(["Once"], held, use_tqdm=False)[0]  # where the grammar may not end yet, still masked
    assert out.finish_reason == "stop" and len(out.text) == 3 and out.text.isalpha(), out
    assert_all_free(llm)


@pytest.mark.parametrize("grammar, regex", [
    ('start: "[" WORD ("," WORD)? "]"\nWORD: /[a-z]{1,4}/', r"\[[a-z]{1,4}(,[a-z]{1,4})?\]"),  # Lark
    ('root ::= "x" [0-9] [0-9]?', r"x[0-9][0-9]?"),  # llama.cpp's GBNF
])
def test_grammars(tiny_checkpoint, grammar, regex):
    llm = LLM(tiny_checkpoint)
    outs = llm.generate(["Once"], constrained({"grammar": grammar}, max_tokens=30, temperature=0.9, seed=2, n=3),
                        use_tqdm=False)
    assert all(o.finish_reason == "stop" and meets({"regex": regex}, o.text) for o in outs), [o.text for o in outs]


def test_a_long_choice_list_is_one_of_its_strings(tiny_checkpoint):
    """Each choice an alternative of its own in the grammar put one parser item per choice in a row, and
    llguidance refuses a row past 2,000: 3,000 choices sharing their first letter ran into it after one
    token and ended as grammar_dead_end. The choices are one lexeme, a matcher of all the strings at once."""
    choices = [f"w{i}" for i in range(3000)]
    llm = LLM(tiny_checkpoint)
    outs = llm.generate(["Once"], constrained({"choice": choices}, max_tokens=8, temperature=1.0, seed=3, n=4),
                        use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["stop"] * 4 and all(o.text in choices for o in outs), outs
    assert_all_free(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_proposals_are_checked_against_the_grammar(tiny_checkpoint, method, caplog):
    """Proposals ride the verify rows, each masked by the state the proposals before it lead to: the output
    is plain decoding's, token for token, and it is said once in the log."""
    spec = {"regex": r"(la ){12}[a-z]{1,3}\."}
    params = constrained(spec, max_tokens=60, temperature=0)
    plain = LLM(tiny_checkpoint).generate(["la la la la"], params, use_tqdm=False)[0]
    extra = {"speculative_model": str(tiny_checkpoint)} if method == "draft" else {}
    llm = LLM(tiny_checkpoint, speculative_method=method, num_speculative_tokens=4, **extra)
    with caplog.at_level(logging.INFO, logger="minfer.structured"):
        outs = llm.generate(["la la la la"] * 2, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [plain.token_ids] * 2 and meets(spec, plain.text)
    stats = llm.stats()
    assert stats["spec_decode_num_drafts"] > 0
    if method == "ngram":  # the draft model proposes its own argmax, blind to the grammar: rejected here
        assert stats["spec_decode_num_accepted_tokens"] > 0
    assert sum("proposals of constrained requests are checked" in m for m in caplog.messages) == 1
    assert_all_free(llm)


def test_a_grammar_with_nothing_left_to_draw_ends_with_a_clear_reason(tiny_checkpoint, caplog):
    """The regex "" allows only an end of sentence, which min_tokens holds back: the row has nothing to draw.
    It is drawn unmasked (never all -inf), its token refused, and the request ends, saying why, once."""
    llm = LLM(tiny_checkpoint)
    with caplog.at_level(logging.WARNING, logger="minfer.structured"):
        outs = llm.generate(["Once"] * 2, [constrained({"regex": ""}, max_tokens=5, min_tokens=2, temperature=t, seed=1)
                                           for t in (0, 0.9)], use_tqdm=False)
    assert [o.finish_reason for o in outs] == [DEAD_END] * 2 and all(len(o.token_ids) == 1 for o in outs)
    assert sum(DEAD_END in m for m in caplog.messages) == 2
    plain = llm.generate(["Once"], constrained({"regex": ""}, max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert plain.finish_reason == "stop" and plain.text == ""  # without min_tokens: the end of sentence
    assert_all_free(llm)


def test_unconstrained_steps_run_no_code_of_the_room(tiny_checkpoint, monkeypatch):
    llm = LLM(tiny_checkpoint)
    for name in ("start", "advance", "add", "check"):
        monkeypatch.setattr(Structured, name, lambda *a, _name=name: pytest.fail(f"Structured.{_name} ran"))
    llm.generate(["Once"] * 3, SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=1), use_tqdm=False)


def test_only_constrained_rows_are_masked(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    room = llm.scheduler.features.structured
    params = [constrained({"regex": r"[a-z]{8}"}, max_tokens=8, temperature=0)] + [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 3
    outs = llm.generate(["Once"] * 4, params, use_tqdm=False)
    assert outs[0].finish_reason == "stop" and all(len(o.token_ids) == 8 for o in outs[1:])
    assert room.stats["rows"] == len(outs[0].token_ids)  # one mask a step, for the one constrained row
    assert not room.live


@pytest.mark.parametrize("spec, words", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "nope"),
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),  # a keyword llguidance does not implement
    ({"json": {"type": "integer", "minimum": 5, "maximum": 3}}, "minimum"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"regex": "(?=a)a"}, "does not compile"),  # what Rust's regex syntax lacks (docs/structured_outputs.md)
    ({"regex": "(a)\\1"}, "does not compile"),
    ({"regex": "\\bhi\\b"}, "does not compile"),
    ({"regex": "a\\"}, "lone backslash"),  # llguidance dropped it: "a" ran
    ({"regex": "\\\\\\"}, "lone backslash"),  # three: an escaped backslash, then a lone one
    ({"json": {"type": "string", "pattern": "\\"}}, "the pattern '\\\\' ends in a lone backslash"),  # any string ran
    ({"json": {"type": "object", "properties": {"x": {"type": "string", "pattern": "b\\"}}}}, "lone backslash"),
    ({"json": {"type": "object", "patternProperties": {"^k\\": {}}}}, "lone backslash"),
    ({"grammar": "start: x y"}, "x"),
    ({"regex": "[^\\x00-\\x{10FFFF}]"}, "the regex allows no text at all"),  # it ran, to a dead end each time
    ({"grammar": "start: /[^\\x00-\\U0010FFFF]/"}, "the grammar allows no text at all"),
    ({"choice": []}, "empty"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
])
def test_bad_constraints_are_refused_naming_the_field(tiny_checkpoint, spec, words):
    llm = LLM(tiny_checkpoint)
    with pytest.raises(InvalidParameter) as e:
        llm.generate(["Once"], constrained(spec, max_tokens=4), use_tqdm=False)
    assert e.value.param == "structured_outputs" and words in str(e.value), str(e.value)
    assert_all_free(llm)


def test_an_escaped_backslash_at_the_end_is_a_regex(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    out = llm.generate(["Once"], constrained({"regex": "a\\\\"}, max_tokens=8, temperature=0))[0]
    assert (out.text, out.finish_reason) == ("a\\", "stop")  # a, then a literal backslash
    # In a schema too; a property named "pattern" is no regex, nor is data (a default)
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "pattern": "^a\\\\$"}},
              "required": ["pattern"], "additionalProperties": False, "default": {"pattern": "data, not a regex\\"}}
    out = llm.generate(["Once"], constrained({"json": schema}, max_tokens=48, temperature=0))[0]
    assert (json.loads(out.text), out.finish_reason) == ({"pattern": "a\\"}, "stop")


def test_the_tokenizer_and_mask_are_as_wide_as_the_logits(make_checkpoint, tmp_path):
    """llguidance's tokenizer comes from minfer's own, tokenizer.json or vocab.json + merges.txt alike; the
    mask has a bit for every row of the logits, and rows past the tokenizer's last token are never allowed."""
    path = make_checkpoint("tiny")
    tokenizer = Tokenizer.from_dir(path)
    import tokenizers

    tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).model.save(str(tmp_path))
    vocab_merges = Tokenizer.from_dir(tmp_path)
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    masks = []
    for tok in (tokenizer, vocab_merges):
        grammars = Grammars(tok, vocab_size=tok.vocab_size + 100)  # a model whose logits outnumber the tokens
        matcher = grammars.matcher(spec)
        assert grammars.llg_tokenizer(grammars_module.import_llguidance()).vocab_size == tok.vocab_size + 100
        words = (tok.vocab_size + 100 + 31) // 32
        bits = torch.zeros(1, words, dtype=torch.int32)
        matcher.consume_tokens(tok.encode('{"a": "'))
        matcher.unsafe_compute_mask_ptr(bits.data_ptr(), 4 * words)
        allowed = unpack(bits, tok.vocab_size + 100)[0]
        assert allowed.sum() > 100 and not allowed[tok.vocab_size :].any()  # past the tokenizer: never
        assert tok.eos_token_id is None or not allowed[tok.eos_token_id]  # inside a string: no end
        masks.append(allowed[: tok.vocab_size])
    assert torch.equal(masks[0][: len(masks[1])], masks[1])  # vocab.json holds all but <|endoftext|>


def test_without_llguidance_a_constrained_request_says_how_to_install_it(tiny_checkpoint, monkeypatch):
    llm = LLM(tiny_checkpoint)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` now fails
    with pytest.raises(InvalidParameter, match="pip install llguidance") as e:
        llm.generate(["Once"], constrained({"regex": "[0-9]{7}"}, max_tokens=4), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert llm.generate(["Once"], SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids  # the rest still runs


def test_llguidance_is_imported_only_when_a_request_asks(tiny_checkpoint):
    code = (
        "import sys; from minfer import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_checkpoint)!r})\n"
        "llm.generate(['Once'], SamplingParams(max_tokens=4), use_tqdm=False)\n"
        "assert 'llguidance' not in sys.modules, 'imported for a plain request'\n"
        "from minfer.engine.structured_outputs_params import StructuredOutputsParams as S\n"
        "out = llm.generate(['Once'], SamplingParams(max_tokens=9, structured_outputs=S(regex='[0-9]{3}')),"
        " use_tqdm=False)[0]\n"
        "assert 'llguidance' in sys.modules and out.finish_reason == 'stop', out\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_discarded_constrained_request_frees_everything(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    scheduler, room = llm.scheduler, llm.scheduler.features.structured
    rid = scheduler.add_request("Once", sampling_params=constrained(CONSTRAINTS[6][0], max_tokens=80, n=2, seed=1))
    for _ in range(4):
        scheduler.step()
    assert room.live and scheduler.discard_request(rid)
    scheduler.add_request("Once", sampling_params=SamplingParams(max_tokens=2))
    list(scheduler.steps())
    scheduler.pop_responses(scheduler.pop_finished_ids()[0])
    assert not room.live  # the discarded sequences' matchers went with them
    assert_all_free(llm)


# minfer-tiny, greedy, writes "[83, 82, 422, 290, 13]" here under the regex: its "." (13) completes the grammar.
COMPLETED_PROMPT = [326, 798, 404, 739, 496, 319, 349, 338, 112, 711, 204, 10, 8, 532, 569, 728]
COMPLETED_PROMPT += COMPLETED_PROMPT[:13]
COMPLETED_REGEX = {"regex": r"[a-z ]{2,12}\."}
DRAFT = {"speculative_method": "draft", "speculative_model": "minfer-tiny-draft"}
# n-gram lookup finds the output, and its end of text and more after it, earlier in the prompt.
NGRAM_PROMPT = COMPLETED_PROMPT + [83, 82, 422, 290, 13, 799, 5, 6] + COMPLETED_PROMPT[-6:]


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos", "ignore_eos"])
@pytest.mark.parametrize(
    "prompt, speculation",
    [
        (COMPLETED_PROMPT, DRAFT | {"num_speculative_tokens": 4}),  # the last proposal completes the grammar
        (COMPLETED_PROMPT, DRAFT | {"num_speculative_tokens": 6}),  # a middle one does: two proposals after it
        (NGRAM_PROMPT, {"speculative_method": "ngram", "ngram_min": 1, "num_speculative_tokens": 4}),
        (NGRAM_PROMPT, {"speculative_method": "ngram", "ngram_min": 1, "num_speculative_tokens": 6}),
    ],
    ids=["draft-last", "draft-middle", "ngram-last", "ngram-middle"],
)
def test_a_proposal_that_completes_the_grammar_is_the_last_token(prompt, speculation, ignore_eos):
    """Plain decoding ends a request at the token that completes its grammar. A verification whose accepted
    proposals run past that token (the completed grammar's end of text, which its mask allows, and with
    ignore_eos whatever follows) emits only up to it: the same tokens, finish_reason and usage."""
    params = constrained(COMPLETED_REGEX, max_tokens=40, temperature=0, ignore_eos=ignore_eos, logprobs=1)
    plain = LLM("minfer-tiny").generate([prompt], params, use_tqdm=False)[0]
    assert plain.token_ids[-1] == 13 and plain.finish_reason == "stop"
    llm = LLM("minfer-tiny", **speculation)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.stats()["spec_decode_num_accepted_tokens"] >= 4  # the "." (the 4th proposal) was accepted
    assert (out.token_ids, out.finish_reason) == (plain.token_ids, plain.finish_reason)
    assert (len(out.prompt_token_ids), out.num_cached_tokens) == (len(plain.prompt_token_ids), plain.num_cached_tokens)
    assert out.text == plain.text and len(out.logprobs) == len(plain.logprobs) == len(plain.token_ids)
    assert_all_free(llm)


def test_a_sampled_verification_ends_where_plain_decoding_does():
    """Seeded sampling draws the tokens plain decoding would; the grammar ends both at the same token."""
    plain_llm = LLM("minfer-tiny")
    llm = LLM("minfer-tiny", **DRAFT, num_speculative_tokens=6)
    for seed in range(4):
        params = constrained(COMPLETED_REGEX, max_tokens=40, temperature=0.8, seed=seed)
        plain = plain_llm.generate([COMPLETED_PROMPT], params, use_tqdm=False)[0]
        out = llm.generate([COMPLETED_PROMPT], params, use_tqdm=False)[0]
        assert (out.token_ids, out.finish_reason) == (plain.token_ids, plain.finish_reason), seed
    assert not llm.scheduler.features.structured.live
