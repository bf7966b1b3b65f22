"""A SentencePiece-style tokenizer (Llama 2's kind: `▁` for a space, byte fallback <0x0A>, <s> before each
prompt), as `minfer random-model --config llama2-tiny` writes it: loading, streaming exactly decode(), and
each token's bytes."""

from __future__ import annotations

import random

import pytest
from tokenizer_texts import TEXTS, stream

from minfer.checkpoints.tokenizer_training import BYTE_TOKENS, SENTENCEPIECE_SPECIALS
from minfer.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(make_checkpoint):
    return Tokenizer.from_dir(make_checkpoint("llama2-tiny"))


def byte_id(tok: Tokenizer, b: int) -> int:
    return tok.token_to_id(f"<0x{b:02X}>")


def test_the_vocabulary_is_laid_out_like_llama_2s(tok):
    assert tok.vocab_size == 512 and tok.eos_token_ids == [2]
    assert [tok.id_to_token(i) for i in range(3)] == SENTENCEPIECE_SPECIALS
    assert [tok.id_to_token(i) for i in range(3, 259)] == BYTE_TOKENS
    assert tok.encode_prompt("Hi")[0] == 1 and 1 not in tok.encode("Hi")  # <s> before a prompt only
    assert tok.encode("a\nb")[1:-1] == [byte_id(tok, 0x0A)]  # a newline falls back to its byte
    assert len(tok.encode("🤖")) == 2 and tok.encode("🤖")[0] == tok.token_to_id("▁")  # a whole emoji, after ▁
    assert [tok.id_to_token(i) for i in tok.encode("日")[1:]] == ["<0xE6>", "<0x97>", "<0xA5>"]


@pytest.mark.parametrize("name", TEXTS)
def test_streaming_matches_decode(tok, name):
    ids = tok.encode(TEXTS[name])
    pieces, streamed = stream(tok, ids)
    assert streamed == tok.decode(ids)
    if not TEXTS[name].startswith(" "):  # Llama 2's decoder drops the first space: a leading one is lost
        assert streamed == TEXTS[name]
    assert not any("\ufffd" in p for p in pieces)  # valid text never shows U+FFFD mid-stream


def test_a_character_in_byte_tokens_comes_out_when_its_run_ends(tok):
    """The bytes of 日 come out together, once a token that is not a byte ends their run (a later byte could
    still make decode() render the whole run as U+FFFD), or at the end of the stream."""
    ids = tok.encode("a日b")
    d = tok.detokenizer()
    assert [d.add(i) for i in ids] == ["a", "", "", "", "日b"]
    d = tok.detokenizer()
    assert [d.add(i) for i in ids[:-1]] == ["a", "", "", ""] and d.flush() == "日" and d.text == "a日"


def test_an_invalid_run_renders_as_decode_renders_it(tok):
    """decode() shows a run of byte tokens holding an invalid byte as one U+FFFD per byte, even the valid
    ones before it: the stream never shows them as anything else first."""
    ids = [tok.token_to_id("▁w"), byte_id(tok, 0x41), byte_id(tok, 0xFF), tok.token_to_id("▁w")]
    assert tok.decode(ids) == "w\ufffd\ufffd w"
    assert stream(tok, ids) == (["w", "", "", "\ufffd\ufffd w", ""], "w\ufffd\ufffd w")
    assert stream(tok, ids[:3]) == (["w", "", "", "\ufffd\ufffd"], "w\ufffd\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_id_streams_match_decode(tok, skip_special_tokens):
    """Random ids are half byte tokens here: runs of invalid bytes, specials and ids outside the vocabulary."""
    rng = random.Random(2024)
    for _ in range(400):
        ids = [rng.randrange(-2, tok.vocab_size + 3) for _ in range(rng.randint(0, 40))]
        d = tok.detokenizer(skip_special_tokens)
        streamed = "".join(d.add(i) for i in ids) + d.flush()
        valid = [i for i in ids if 0 <= i < tok.vocab_size]
        assert streamed == tok.backend.decode(valid, skip_special_tokens=skip_special_tokens), ids


def test_special_tokens_are_skipped_without_moving_a_space(tok):
    """A skipped <s> between words leaves the words as decode() joins them (the decoder never sees it)."""
    ids = tok.encode("a b") + [1] + tok.encode("c d")
    assert stream(tok, ids)[1] == tok.decode(ids) == "a b c d"
    d = tok.detokenizer(skip_special_tokens=False)
    assert "".join(d.add(i) for i in ids) + d.flush() == tok.backend.decode(ids, skip_special_tokens=False)


def test_token_bytes_read_spaces_and_byte_fallback(tok):
    table = tok.token_bytes
    assert table[byte_id(tok, 0x0A)] == b"\n" and table[byte_id(tok, 0xE6)] == b"\xe6"
    assert table[tok.token_to_id("▁w")] == b" w" and table[tok.token_to_id("🤖")] == "🤖".encode()
    assert table[0] == table[1] == table[2] == b""  # <unk>, <s>, </s> add no text
    text = "x = 1\nnaïve 日本 🤖"
    assert b"".join(table[i] for i in tok.encode(text)) == b" " + text.encode()  # the ▁ put first


def test_logprobs_show_each_tokens_text_and_bytes(tok):
    """Chat logprobs' `token` and `bytes`, and completions' `tokens`, for `▁`, byte and special tokens."""
    from minfer.scoring.logprobs import TokenLogprob
    from minfer.server.logprobs_format import LogprobFormatter

    newline, w, e_acute_lead = byte_id(tok, 0x0A), tok.token_to_id("▁w"), byte_id(tok, 0xC3)
    entries = [TokenLogprob(t, -1.0, 1, ((t, -1.0), (2, -2.0))) for t in (w, newline, e_acute_lead)]
    chat = LogprobFormatter(tok).chat(entries, 2)["content"]
    assert [(c["token"], c["bytes"]) for c in chat] == [(" w", [32, 119]), ("\n", [10]), ("\ufffd", [0xC3])]
    assert chat[0]["top_logprobs"][1]["token"] == "</s>"  # a special token shows its name
    completion = LogprobFormatter(tok).completion([w, newline], entries[:2], 1)
    assert completion["tokens"] == [" w", "\n"] and completion["text_offset"] == [0, 2]


@pytest.mark.parametrize("prompt, expected", [
    ("Once upon a time", " there was"),  # after a word
    ("café\n", " there was"),  # after a newline spelt in a byte token
    ("", "there was"),  # after nothing but <s>: the start of the text, as decode() has it
])
def test_a_continuation_keeps_its_first_space(tok, prompt, expected):
    """decode() drops the space of a text's first token (`▁there`); a completion continues its prompt's text,
    so its detokenizer, given the prompt as context, keeps it, as decode() of prompt and completion does."""
    context, ids = tok.encode_prompt(prompt), tok.encode(" there was")
    d = tok.detokenizer(context=context)
    text = "".join(d.add(i) for i in ids) + d.flush()
    assert text == expected
    whole, before = tok.decode(context + ids), tok.decode(context)
    assert whole.startswith(before) and whole[len(before):] == expected
    assert "".join(map(tok.detokenizer().add, ids)) == "there was"  # no context: a text's start


def spelt_ids(tok: Tokenizer, spelt) -> list[int]:
    """Ids from tokens spelt as strings, or as ints for byte tokens (0x41: <0x41>)."""
    ids = [tok.token_to_id(s) if isinstance(s, str) else byte_id(tok, s) for s in spelt]
    assert None not in ids, spelt
    return ids


def continuation(tok: Tokenizer, context: list[int], ids: list[int]) -> tuple[list[str], str]:
    d = tok.detokenizer(context=context)
    pieces = [d.add(i) for i in ids]
    return pieces, "".join(pieces) + d.flush()


@pytest.mark.parametrize("spelt", [
    ["<s>", 0x41],  # <s> and a byte: the window was left empty once the byte was left out
    ["<s>", 0x20],  # a byte that is a space: decode() drops it as a text's first space, not the next one
    ["<s>", "▁w", *[0x0A] * 8],  # more trailing bytes than the window holds
    ["<s>", "▁", 0xE6, 0x97, 0xA5, 0xE6, 0x9C, 0xAC, 0xE8, 0xAA, 0x9E],  # 日本語, a byte each
    ["<s>", "▁w", 0xE6, 0x97],  # a character cut at the prompt's end: its bytes show as U+FFFD (the window: ▁w)
    ["<s>", 0xE6, 0x97, 0xA5, 0xE6, 0x9C, 0xAC, 0xE8],  # cut, after bytes only
    ["<s>", 0xFF],  # an invalid byte alone
])
def test_a_continuation_after_byte_tokens_keeps_its_first_space(tok, spelt):
    """A prompt (as ids) whose window the detokenizer leaves empty, its trailing byte tokens left out: the
    continuation still continues the prompt's text, as decode() of prompt and continuation has it. (It was taken
    for a text's start: `▁there` came out as 'there'.)"""
    context = spelt_ids(tok, spelt)
    assert not tok.starts_text(context)
    for words in (" there was", " 🤖!", "\nw"):
        ids = tok.encode(words)
        pieces, text = continuation(tok, context, ids)
        whole, before = tok.decode(context + ids), tok.decode(context)
        assert whole.startswith(before) and text == whole[len(before):], (words, text)
        assert all(whole[len(before):].startswith("".join(pieces[:k])) for k in range(len(ids)))  # token by token


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_continuations_of_prompts_ending_in_bytes_match_decode(tok, skip_special_tokens):
    """Random prompts of bytes (whole characters, cut ones, invalid ones), words and <s>, and random
    continuations: the continuation's text is what decode() of prompt and continuation adds to the prompt's,
    wherever the prompt ends in whole characters and no run of bytes spans the two (decode() would render it
    whole, rewriting the prompt's text: the stream renders the continuation's part on its own)."""
    rng, checked = random.Random(11), 0
    pool = spelt_ids(tok, ["<s>", "▁w", "▁", "🤖", 0x20, 0x0A, 0x41, 0xC3, 0xA9, 0xE6, 0x97, 0xA5, 0xFF])
    shown = [i for i in pool if not (skip_special_tokens and i == 1)]
    for _ in range(600):
        context = [1] + [rng.choice(pool) for _ in range(rng.randint(0, 6))]
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 6))]
        whole = tok.backend.decode(context + ids, skip_special_tokens=skip_special_tokens)
        before = tok.backend.decode(context, skip_special_tokens=skip_special_tokens)
        last, first = [i for i in context if i in shown][-1:], [i for i in ids if i in shown][:1]
        if before.endswith("\ufffd") or last and first and {*last, *first} <= tok.byte_fallback_ids:
            continue  # a cut character at the prompt's end, or a run of bytes across the two
        d = tok.detokenizer(skip_special_tokens, context=context)
        assert "".join(d.add(i) for i in ids) + d.flush() == whole[len(before):], (context, ids)
        checked += 1
    assert checked > 150, checked


def completion_offsets(tok: Tokenizer, ids: list[int], cuts: tuple[int, ...] = (), starts_text=False) -> list[int]:
    """text_offset of a completion's tokens, formatted whole, or in pieces cut at `cuts` as a stream's chunks;
    starts_text: the completion starts the text (its prompt a lone <s>)."""
    from minfer.server.logprobs_format import LogprobFormatter

    formatter, offsets = LogprobFormatter(tok, starts_text=starts_text), []
    for start, stop in zip((0, *cuts), (*cuts, len(ids))):
        offsets += formatter.completion(ids[start:stop], [None] * (stop - start), 0, final=stop == len(ids))[
            "text_offset"]
    return offsets


@pytest.mark.parametrize("spelt, expected", [
    (["▁w", 0xE6, 0x97, "▁w"], [0, 2, 3, 4]),  # a cut character: one U+FFFD per byte (" w\ufffd\ufffd w")
    (["▁w", 0xE6, 0x97, 0xA5, 0xFF, "▁w"], [0, 2, 3, 4, 5, 6]),  # an invalid byte: 日's bytes show so too
    (["▁w", 0xE6, 0x97, 0xA5, "▁w"], [0, 2, 2, 2, 3]),  # 日: its bytes at its start
    (["▁w", 0xE6, 0x97], [0, 2, 3]),  # cut by the end of the text
    (["▁w", 0x41, 0xC3, 0xA9, "▁w", 0xC3], [0, 2, 3, 3, 4, 6]),  # " wAé w\ufffd": a valid run, then a cut é
])
def test_completion_offsets_follow_how_byte_runs_render(tok, spelt, expected):
    """A run of byte tokens holding an invalid byte renders as one U+FFFD per byte (the test above): the offsets
    of its tokens and of all after it count them so, streamed in pieces or not. A stream's chunk carries the
    tokens up to one whose text it shows: a run's text comes when it ends, and where a step of several tokens
    ends inside a run, the run's tokens wait for the next chunk (ScoredChoices). Counted with a cut inside a run,
    as here, offsets are right if the run makes characters."""
    ids = [tok.token_to_id(s) if isinstance(s, str) else byte_id(tok, s) for s in spelt]
    d = tok.detokenizer(context=tok.encode_prompt("Hi"))  # a continuation: its first space kept
    text = "".join(d.add(i) for i in ids) + d.flush()
    assert completion_offsets(tok, ids) == expected, text
    for cut in range(1, len(ids)):
        if ids[cut - 1] not in tok.byte_fallback_ids or "\ufffd" not in text:
            assert completion_offsets(tok, ids, (cut,)) == expected, cut
    words = [(o, tok.token_bytes[i].decode()) for o, i in zip(expected, ids) if i not in tok.byte_fallback_ids]
    assert all(text[o:o + len(word)] == word for o, word in words), text


@pytest.mark.parametrize("spelt, text, expected", [
    (["▁w", "▁w"], "w w", [0, 1]),  # the first word's space dropped
    (["<s>", "▁", "▁w"], " w", [0, 0, 0]),  # a skipped <s> adds nothing; `▁` is the dropped space
    ([0x20, 0x41, "▁w"], "A w", [0, 0, 1]),  # a valid run's first byte, a space, dropped too
    ([0x20, 0xFF, "▁w"], "\ufffd\ufffd w", [0, 1, 2]),  # an invalid run's space shows as U+FFFD: kept
])
def test_offsets_of_a_text_start_count_without_the_dropped_space(tok, spelt, text, expected):
    """A completion of <s> alone starts the text: decode() drops its first character if it renders as a space."""
    ids = [tok.token_to_id(s) if isinstance(s, str) else byte_id(tok, s) for s in spelt]
    assert tok.decode(ids) == text
    assert completion_offsets(tok, ids, starts_text=True) == expected
    assert completion_offsets(tok, ids, (2,), starts_text=True) == expected  # streamed in two chunks


@pytest.mark.parametrize("prompt", ["Hi", ""])
def test_random_completion_offsets_index_the_text(tok, prompt):
    """Random runs of bytes, words and skipped specials: each word's text stands at its offset, a byte of an
    invalid run at a U+FFFD of its own. After an empty prompt (<s> alone) the text starts with the completion, and
    the decoder drops its first space, a word's or a valid run's."""
    rng = random.Random(7)
    context = tok.encode_prompt(prompt)
    assert tok.starts_text(context) == (not prompt) and tok.drops_first_space
    words = [tok.token_to_id(w) for w in ("▁w", "▁", "🤖")]
    for _ in range(300):
        ids = [rng.choice([*words, 1, *[byte_id(tok, b) for b in (0x20, 0x41, 0xC3, 0xA9, 0xE6, 0x97, 0xA5, 0xFF)]])
               for _ in range(rng.randint(1, 16))]
        d = tok.detokenizer(context=context)
        text = "".join(d.add(i) for i in ids) + d.flush()
        offsets = completion_offsets(tok, ids, starts_text=not prompt)
        assert offsets == sorted(offsets) and offsets[-1] <= len(text), (ids, text, offsets)
        first = next((n for n, i in enumerate(ids) if tok.token_bytes[i]), None)
        for n, (o, i) in enumerate(zip(offsets, ids)):
            piece = tok.token_bytes[i].decode("utf-8", "replace")
            if n == first and not prompt and not text.startswith(piece):
                piece = piece.removeprefix(" ")  # the space the decoder dropped
            assert i in tok.byte_fallback_ids or text[o:o + len(piece)] == piece, (ids, text, offsets)
        if not prompt:
            assert text == tok.decode(ids), ids
