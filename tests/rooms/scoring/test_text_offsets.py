"""/v1/completions' `text_offset`: where each token's text starts in the choice's text, with echo, whatever
the tokenizer adds (Llama's BOS, a SentencePiece first token's space) or splits (a character over two tokens),
streamed or not. (A BOS once shifted every offset by its name's length, and each split character by one.)"""

import json

import pytest
from serving import API_KEY, call, serving, stream_events

from minfer import EngineConfig
from minfer.text.tokenizer import Tokenizer

PROMPT = "Hello world, é 日本 ok"  # é and 日 are two and three bytes: the test tokenizers split them


def expected_offsets(tok: Tokenizer, text: str, ids: list[int]) -> list[int]:
    """Each token's offset, from where its bytes start in the text's UTF-8 (a character it only ends counts
    from the character's start)."""
    data = text.encode()
    spelt = b"".join(tok.token_bytes[i] for i in ids)
    skipped = len(spelt) - len(data)  # a SentencePiece decoder drops the first token's space
    assert spelt[skipped:] == data and skipped in (0, 1)
    starts, at = [], -skipped
    for i in ids:
        starts.append(len(data[: max(0, at)].decode("utf-8", "ignore")))
        at += len(tok.token_bytes[i])
    return starts


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "llama2-tiny"])
def test_echoed_offsets_index_the_text(make_checkpoint, preset):
    ckpt = make_checkpoint(preset)
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.encode_prompt(PROMPT)
    assert len(ids) > len(tok.encode(PROMPT)) or preset == "tiny"  # the Llamas' BOS is in the prompt
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    with serving(EngineConfig(str(ckpt), num_kv_blocks=64), api_key=API_KEY) as srv:
        port = srv.server_address[1]
        status, _, whole = call(port, "POST", "/v1/completions", body)
        events = stream_events(port, "/v1/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    offsets, text = choice["logprobs"]["text_offset"], choice["text"]
    assert text.startswith(PROMPT)
    assert offsets[: len(ids)] == expected_offsets(tok, PROMPT, ids)
    assert offsets[len(ids)] == len(PROMPT)  # the completion's first token starts where the prompt ends
    assert offsets == sorted(offsets) and all(o <= len(text) for o in offsets)
    streamed = [o for e in events[:-1] for c in e["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert streamed == offsets, json.dumps(events)
