"""/v1/completions' `text_offset`: where each token's text starts in the choice's text, with echo, whatever
the tokenizer adds (Llama's BOS, a SentencePiece first token's space), splits (a character over two tokens)
or reads as one special token (its name written in the prompt), streamed or not. (A BOS once shifted every
offset by its name's length, and each split character by one.)"""

import json

import pytest
from serving import API_KEY, call, serving, stream_events

from minfer import EngineConfig
from minfer.text.tokenizer import Tokenizer

# é and 日 are two and three bytes: the test tokenizers split them; each model reads its own special token
# (GPT-2's <|endoftext|>, Llama 2's <s>, Llama 3's <|begin_of_text|>) as one id, whose name the echoed text holds
PROMPT = "Hello world, é 日本 <|endoftext|><s><|begin_of_text|> ok"


def expected_offsets(text: str, pieces: list[bytes]) -> list[int]:
    """Each token's offset, from where its bytes (`pieces`) start in the text's UTF-8 (a character it only ends
    counts from the character's start)."""
    data, spelt = text.encode(), b"".join(pieces)
    skipped = len(spelt) - len(data)  # a SentencePiece decoder drops the first token's space
    assert spelt[skipped:] == data and skipped in (0, 1)
    starts, at = [], -skipped
    for piece in pieces:
        starts.append(len(data[: max(0, at)].decode("utf-8", "ignore")))
        at += len(piece)
    return starts


def offsets_and_stream(ckpt, body) -> tuple[dict, list[int]]:
    """The whole choice, and the text_offset its stream's chunks carry, one after another."""
    with serving(EngineConfig(str(ckpt), num_kv_blocks=64), api_key=API_KEY) as srv:
        port = srv.server_address[1]
        status, _, whole = call(port, "POST", "/v1/completions", body)
        events = stream_events(port, "/v1/completions", body)
    assert status == 200, whole
    streamed = [o for e in events[:-1] for c in e["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert streamed == whole["choices"][0]["logprobs"]["text_offset"], json.dumps(events)
    return whole["choices"][0], streamed


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "llama2-tiny"])
@pytest.mark.parametrize("as_ids", [False, True])
def test_echoed_offsets_index_the_text(make_checkpoint, preset, as_ids):
    ckpt = make_checkpoint(preset)
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.encode_prompt(PROMPT)
    added = len(ids) - len(tok.encode(PROMPT))
    assert added == (preset != "tiny")  # the Llamas' BOS
    body = {"prompt": ids if as_ids else PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    choice, offsets = offsets_and_stream(ckpt, body)
    if as_ids:  # echoed as their decoding, which drops special tokens
        prompt, pieces = tok.decode(ids), [tok.token_bytes[t] for t in ids]
    else:  # echoed as sent: the special token written in it spans its name; the BOS, nothing
        spelt = [tok.token_bytes[t] or tok.id_to_token(t).encode() for t in ids[added:]]
        prompt, pieces = PROMPT, [b""] * added + spelt
        assert sum(not tok.token_bytes[t] for t in ids[added:]) == 1
    assert choice["text"].startswith(prompt) and len(offsets) == len(ids) + 3
    assert offsets[: len(ids)] == expected_offsets(prompt, pieces)
    assert offsets[len(ids)] == len(prompt)  # the completion's first token starts where the prompt ends
    assert offsets == sorted(offsets) and all(o <= len(choice["text"]) for o in offsets)


def test_special_tokens_shown_in_the_text_span_their_names(make_checkpoint):
    """skip_special_tokens false: a generated special token's name is in the text, and in the offsets."""
    ckpt = make_checkpoint("tiny")
    eos = Tokenizer.from_dir(ckpt).eos_token_id
    body = {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "logit_bias": {str(eos): 100}, "logprobs": 0}
    shown, offsets = offsets_and_stream(ckpt, {**body, "skip_special_tokens": False})
    name = shown["logprobs"]["tokens"][0]
    assert shown["text"] == name * 3 and offsets == [0, len(name), 2 * len(name)]
    hidden, offsets = offsets_and_stream(ckpt, body)
    assert hidden["text"] == "" and offsets == [0, 0, 0]


def test_a_stream_ending_in_a_cut_character_counts_it_as_the_text_shows_it(make_checkpoint):
    """A run of byte tokens the text ends in unfinished (<0xE6><0x97>: max_tokens reached) shows one U+FFFD per
    byte: the last chunk's offsets count them so, as a whole response's do (text_offsets.py)."""
    from minfer import SamplingParams
    from minfer.engine.outputs import CompletionDelta
    from minfer.scoring.logprobs import TokenLogprob
    from minfer.server.requests import ParsedRequest
    from minfer.server.responder import Responder

    tok = Tokenizer.from_dir(make_checkpoint("llama2-tiny"))
    w, e6, x97 = tok.token_to_id("▁w"), tok.token_to_id("<0xE6>"), tok.token_to_id("<0x97>")
    r = Responder("m", False, ParsedRequest([tok.encode_prompt("Hi")], SamplingParams(logprobs=0)), tok)
    deltas = [CompletionDelta(0, [w], " w", None, [TokenLogprob(w, -1.0)]),
              CompletionDelta(0, [e6], "", None, [TokenLogprob(e6, -1.0)]),
              CompletionDelta(0, [x97], "\ufffd\ufffd", "length", [TokenLogprob(x97, -1.0)])]
    chunks = [choice for d in deltas for chunk in r.delta_chunks(d) for choice in chunk["choices"]]
    assert "".join(c["text"] for c in chunks) == " w\ufffd\ufffd"
    assert [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]] == [0, 2, 3]


@pytest.mark.parametrize("skip_special_tokens, text, expected", [
    (True, "there was", [0, 3, 5, 7]),  # after <s> alone the text starts: its decoder drops the first space
    (False, " there was", [0, 4, 6, 8]),  # <s> shown: the text continues it, space and all
])
def test_a_completion_that_starts_the_text_counts_without_its_dropped_space(make_checkpoint, skip_special_tokens,
                                                                            text, expected):
    """A prompt of <s> alone (an empty prompt): Llama 2's decoder drops the completion's first space, as it drops
    a text's; the offsets, whole or streamed, count without it. (They counted it: 'there was' had [0, 4, 6, 8].)"""
    from minfer import SamplingParams
    from minfer.engine.outputs import CompletionDelta, RequestOutput
    from minfer.scoring.logprobs import TokenLogprob
    from minfer.server.requests import ParsedRequest
    from minfer.server.responder import Responder

    tok = Tokenizer.from_dir(make_checkpoint("llama2-tiny"))
    prompt, ids = tok.encode_prompt(""), tok.encode(" there was")
    assert prompt == [1] and len(ids) == 4
    detokenizer = tok.detokenizer(skip_special_tokens, context=prompt)
    pieces = [detokenizer.add(i) for i in ids]
    assert "".join(pieces) + detokenizer.flush() == text
    params = SamplingParams(logprobs=0, skip_special_tokens=skip_special_tokens)
    req = ParsedRequest([prompt], params)
    entries = [TokenLogprob(i, -1.0) for i in ids]
    whole = Responder("m", False, req, tok).response([(RequestOutput("r", prompt, ids, text, "length",
                                                                     logprobs=entries),)])
    assert whole["choices"][0]["logprobs"]["text_offset"] == expected
    r = Responder("m", False, req, tok)
    deltas = [CompletionDelta(0, [i], piece, "length" if n == 3 else None, [entry])
              for n, (i, piece, entry) in enumerate(zip(ids, pieces, entries))]
    chunks = [choice for d in deltas for chunk in r.delta_chunks(d) for choice in chunk["choices"]]
    assert "".join(c["text"] for c in chunks) == text
    assert [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]] == expected


@pytest.mark.parametrize("echo", [False, True])
def test_an_empty_prompts_completion_offsets_index_its_text(make_checkpoint, echo):
    """Served: a completion of an empty Llama 2 prompt (<s> alone), echoed or not: each token's text stands at its
    offset, the first without the space the decoder dropped; streamed, the echoed <s> keeps its offset too."""
    ckpt = make_checkpoint("llama2-tiny")
    body = {"prompt": "", "max_tokens": 8, "temperature": 0, "logprobs": 0, "echo": echo}
    choice, offsets = offsets_and_stream(ckpt, body)
    tokens = choice["logprobs"]["tokens"][echo:]  # after the echoed <s>, at 0
    assert len(offsets) == 8 + echo and offsets[:echo + 1] == [0] * (echo + 1)
    assert choice["text"].startswith(tokens[0].removeprefix(" ")), choice
    placed = [(o, t) for o, t in zip(offsets[echo + 1:], tokens[1:]) if "\ufffd" not in t]  # a byte's, alone
    assert placed and all(choice["text"][o:o + len(t)] == t for o, t in placed), (choice, offsets)


def test_a_run_of_bytes_split_between_steps_streams_the_offsets_a_whole_response_has(make_checkpoint):
    """A step of several tokens (speculative decoding) can end inside a run of byte tokens whose text the
    detokenizer holds until the run ends: the run's tokens wait for that text, so their offsets are counted once
    the run shows whether it is valid. (They went with the chunk before: 日's first bytes at 2, 2, where the
    invalid run that followed puts them at 2, 3.)"""
    from minfer import SamplingParams
    from minfer.engine.outputs import CompletionDelta, RequestOutput
    from minfer.scoring.logprobs import TokenLogprob
    from minfer.server.requests import ParsedRequest
    from minfer.server.responder import Responder

    tok = Tokenizer.from_dir(make_checkpoint("llama2-tiny"))
    w, e6, x97, ff = (tok.token_to_id(t) for t in ("▁w", "<0xE6>", "<0x97>", "<0xFF>"))
    prompt, steps = tok.encode_prompt("Hi"), [[w, e6, x97], [ff, w]]
    d = tok.detokenizer(context=prompt)
    texts = ["".join(d.add(i) for i in step) for step in steps]
    assert texts == [" w", "\ufffd\ufffd\ufffd w"]
    ids, req = steps[0] + steps[1], ParsedRequest([prompt], SamplingParams(logprobs=0))
    entries = [TokenLogprob(i, -1.0) for i in ids]
    out = RequestOutput("r", prompt, ids, "".join(texts), "length", logprobs=entries)
    whole = Responder("m", False, req, tok).response([(out,)])["choices"][0]["logprobs"]
    assert whole["text_offset"] == [0, 2, 3, 4, 5]
    r = Responder("m", False, req, tok)
    deltas = [CompletionDelta(0, steps[0], texts[0], None, entries[:3]),
              CompletionDelta(0, steps[1], texts[1], "length", entries[3:])]
    chunks = [c for d in deltas for chunk in r.delta_chunks(d) for c in chunk["choices"] if c["logprobs"]]
    assert [c["logprobs"]["tokens"] for c in chunks] == [[" w"], ["\ufffd", "\ufffd", "\ufffd", " w"]]
    assert [o for c in chunks for o in c["logprobs"]["text_offset"]] == whole["text_offset"]
