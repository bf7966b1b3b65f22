"""Tests for minfer.text.tokenizer: loading, EOS lookup, round trips and streaming decode, for byte-level BPE
(GPT-2 style) and SentencePiece-style (Llama 2: `▁`, byte fallback) tokenizers, and any other decoder."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import tokenizers
from tokenizers import decoders, pre_tokenizers
from tokenizers.decoders import DecodeStream
from tokenizer_texts import TEXTS, stream

from minfer.checkpoints import EOS_TOKEN, write_random_checkpoint
from minfer.text import tokenizer as tokenizer_module
from minfer.text.token_bytes import bytes_to_unicode
from minfer.text.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), preset="tiny")


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def checkpoint_copy(ckpt, dest, files=("tokenizer.json",)):
    dest.mkdir()
    for name in files:
        shutil.copy(ckpt / name, dest / name)
    return dest


# ---- byte table ------------------------------------------------------------------


def test_bytes_to_unicode_is_gpt2_table():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"
    assert table[0] == chr(256) and table[0xAD] == chr(323)


# ---- encode / decode -------------------------------------------------------------


@pytest.mark.parametrize("name", TEXTS)
def test_round_trip(tok, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_encode_adds_no_special_tokens_and_decode_skips_them(tok):
    assert tok.eos_token_id not in tok.encode("hello")
    ids = tok.encode(f"hi{EOS_TOKEN}there")
    assert ids.count(tok.eos_token_id) == 1  # the literal text is the one special id
    assert tok.decode(ids) == "hithere"


def test_vocab_size_counts_added_tokens(tok):
    assert tok.vocab_size == 512
    assert tok.id_to_token(tok.eos_token_id) == EOS_TOKEN
    assert tok.token_to_id(EOS_TOKEN) == 511
    assert tok.id_to_token(-1) is None and tok.id_to_token(512) is None


def test_decode_accepts_tensors(tok):
    torch = pytest.importorskip("torch")
    ids = tok.encode(TEXTS["mixed"])
    assert tok.decode(torch.tensor(ids)) == TEXTS["mixed"]


# ---- streaming -------------------------------------------------------------------


@pytest.mark.parametrize("name", TEXTS)
def test_streaming_matches_decode(tok, name):
    ids = tok.encode(TEXTS[name])
    pieces, streamed = stream(tok, ids)
    assert streamed == tok.decode(ids) == TEXTS[name]
    # Valid text must never show a replacement character mid-stream: split chars come out whole.
    assert not any("\ufffd" in p for p in pieces)


def test_test_texts_really_split_characters_across_tokens(tok):
    """Guard for the test above: it only means something if some token is not valid UTF-8 alone."""
    split_tokens = {
        name: [i for i in tok.encode(text) if not _is_utf8(tok.token_bytes[i])] for name, text in TEXTS.items()
    }
    assert split_tokens["cjk"] and split_tokens["emoji"], split_tokens
    # ...and the detokenizer holds such a partial character back instead of emitting it.
    ids = tok.encode(TEXTS["emoji"])
    d = tok.detokenizer()
    assert any(d.add(i) == "" for i in ids)


def test_split_character_is_held_back_then_emitted_whole(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1, "need the emoji to span tokens"
    d = tok.detokenizer()
    outputs = [d.add(i) for i in ids]
    assert outputs[:-1] == [""] * (len(ids) - 1) and outputs[-1] == "🤖"
    assert d.flush() == "" and d.text == "🤖"


def test_flush_renders_an_incomplete_tail_like_decode(tok):
    lead = tok.token_bytes.index(b"\xf0")  # first byte of a 4-byte character, alone
    d = tok.detokenizer()
    assert d.add(tok.token_to_id("a")) == "a"
    assert d.add(lead) == ""
    assert d.flush() == "\ufffd" == tok.decode([lead])


def test_random_id_streams_match_decode(tok):
    # Random ids produce invalid UTF-8 everywhere. `tokenizers` renders it with Rust's
    # String::from_utf8_lossy, Python's "replace" handler with its own rules; both replace
    # each "maximal subpart" of an ill-formed sequence with one U+FFFD, so they agree.
    rng = random.Random(1234)
    for _ in range(400):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 40))]
        assert stream(tok, ids)[1] == tok.decode(ids), ids


@pytest.mark.parametrize("name", ["cjk", "emoji", "accented"])
def test_a_continuation_after_a_prompt_cut_anywhere_continues_its_text(tok, name):
    """Byte-level BPE: a prompt ending mid-character is a text too (its bytes show as U+FFFD). A continuation
    that leaves the character cut adds what decode() of the two adds; one that completes it renders its own
    bytes alone, the prompt's text as shown never rewritten."""
    ids, word = tok.encode(TEXTS[name]), tok.encode(" w")
    for cut in range(1, len(ids)):
        prompt, rest = ids[:cut], ids[cut:]
        assert not tok.starts_text(prompt)
        for continued in (word, rest + word):
            d = tok.detokenizer(context=prompt)
            text = "".join(d.add(i) for i in continued) + d.flush()
            whole, before = tok.decode(prompt + continued), tok.decode(prompt)
            assert text == (whole[len(before):] if whole.startswith(before) else tok.decode(continued)), cut


def test_random_byte_streams_match_decode(tok):
    # Single-byte tokens concentrated on UTF-8 lead/continuation bytes exercise the edge cases
    # (overlongs, surrogates, > U+10FFFF, truncated sequences) that random ids rarely hit.
    byte_id = {b[0]: i for i, b in enumerate(tok.token_bytes) if len(b) == 1}
    assert len(byte_id) == 256
    rng = random.Random(99)
    tricky = [0x80, 0xBF, 0xC0, 0xC1, 0xC2, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0x41]
    for _ in range(1000):
        raw = bytes(rng.choice(tricky + [rng.randrange(256)]) for _ in range(rng.randint(1, 10)))
        ids = [byte_id[b] for b in raw]
        assert stream(tok, ids)[1] == tok.decode(ids) == raw.decode("utf-8", "replace"), raw


@pytest.mark.parametrize("raw, expected", [
    (b"\xe2\x82\xaca", [0, 0, 0, 1]),  # €, then a: a character's bytes at its start
    (b"\xe2\x82a", [0, 0, 1]),  # a cut €: one U+FFFD, where it starts
    (b"\xe0\x80a", [0, 1, 2]),  # 0x80 cannot follow 0xE0: a U+FFFD each
    (b"\xf0A", [0, 1]),
])
def test_text_offsets_count_characters_as_decode_renders_them(tok, raw, expected):
    """Where each one-byte token's text starts in what decode() makes of the bytes (UTF-8 with replacement)."""
    from minfer.text.text_offsets import TextOffsets

    byte_id = {b[0]: i for i, b in enumerate(tok.token_bytes) if len(b) == 1}
    ids = [byte_id[b] for b in raw]
    counter = TextOffsets(tok)
    assert counter.offsets(ids) == expected and counter.text_offset == len(tok.decode(ids)), tok.decode(ids)


def test_out_of_vocab_ids_are_ignored(tok):
    ids = tok.encode(TEXTS["mixed"])
    junk = [-1, -(2**40), tok.vocab_size, tok.vocab_size + 7, 2**40]
    mixed = [x for pair in zip(ids, junk * len(ids)) for x in pair]
    assert tok.decode(mixed) == tok.decode(ids) == TEXTS["mixed"]
    d = tok.detokenizer()
    assert [d.add(j) for j in junk] == [""] * len(junk)
    assert stream(tok, mixed)[1] == TEXTS["mixed"]
    assert [tok.text_bytes(j) + tok.shown_bytes(j) for j in junk] == [b""] * len(junk)  # they add no bytes either


def test_special_tokens_stream_as_nothing(tok):
    d = tok.detokenizer()
    assert d.add(tok.eos_token_id) == ""
    ids = tok.encode("a") + [tok.eos_token_id] + tok.encode("b")
    assert stream(tok, ids)[1] == tok.decode(ids) == "ab"


def test_added_tokens_stream_like_decode(ckpt):
    # `tokenizers` sends added (non-special) tokens through the ByteLevel decoder too: one made
    # only of byte-table characters is mapped back to bytes ("ĠxĠ" -> " x ", "éé" -> b"\xe9\xe9"),
    # anything else is taken as its UTF-8. Streaming and token_bytes must agree with it exactly.
    backend = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    added = ["héllo wörld", "ĠxĠ", "éé", "🤖bot"]
    assert all(backend.token_to_id(a) is None for a in added)
    assert backend.add_tokens(added) == len(added)
    t = Tokenizer(backend, eos_token_id=511)
    assert t.vocab_size == 512 + len(added)
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(t.vocab_size) for _ in range(rng.randint(1, 12))]
        ids += rng.sample(range(512, t.vocab_size), 2)
        rng.shuffle(ids)
        assert stream(t, ids)[1] == t.decode(ids), ids
    assert [t.decode([t.token_to_id(a)]) for a in added] == ["héllo wörld", " x ", "\ufffd\ufffd", "🤖bot"]
    assert [t.token_bytes[t.token_to_id(a)] for a in added] == ["héllo wörld".encode(), b" x ", b"\xe9\xe9", "🤖bot".encode()]


def test_streaming_never_calls_full_decode(tok, monkeypatch):
    """O(1) amortized: each id reaches the DecodeStream (which decodes a short window) exactly once, and
    the only decode() left, the flush of a held tail, decodes a few ids, never the sequence."""

    class RecordingDecode:  # the Rust-backed Tokenizer can't be monkeypatched, so wrap it
        def __init__(self, inner):
            self.inner, self.decoded = inner, []

        def decode(self, ids, skip_special_tokens=True):
            self.decoded.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

        def __getattr__(self, name):
            if name == "decode_batch":
                raise AssertionError(f"streaming called the full {name}()")
            return getattr(self.inner, name)

    fed = []

    class RecordingStream:
        def __init__(self, ids=None, skip_special_tokens=False):
            self.inner = DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)

        def step(self, backend, ids):
            fed.append(len(ids) if isinstance(ids, list) else 1)
            return self.inner.step(backend.inner, ids)

    backend = RecordingDecode(tok.backend)
    guarded = Tokenizer(backend, tok.eos_token_id)
    monkeypatch.setattr(tokenizer_module, "DecodeStream", RecordingStream)
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size) for _ in range(2000)]
    ids += [tok.token_bytes.index(b"\xf0")]  # a held tail for flush to render
    d = guarded.detokenizer()
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert sum(fed) == sum(1 for i in ids if i != tok.eos_token_id)  # each id once: linear, not quadratic
    assert len(backend.decoded) == 2 and max(backend.decoded) < 10  # flush: the last window, without and with the tail
    assert out == d.text == tok.decode(ids)


@pytest.mark.parametrize("decoder", [decoders.Metaspace(), decoders.WordPiece(), decoders.BPEDecoder()],
                         ids=["Metaspace", "WordPiece", "BPEDecoder"])
def test_every_decoder_streams_like_decode(ckpt, decoder):
    """Any decoder the `tokenizers` library reads streams, not only byte-level ones: the stream is decode()."""
    backend = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    backend.decoder = decoder
    t = Tokenizer(backend, eos_token_id=511)
    rng = random.Random(5)
    for _ in range(100):
        ids = [rng.randrange(t.vocab_size) for _ in range(rng.randint(0, 30))]
        assert stream(t, ids)[1] == t.decode(ids), ids
    assert all(isinstance(b, bytes) for b in t.token_bytes) and t.token_bytes[511] == b""


def test_detokenizer_is_usable_directly(ckpt):
    backend = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    e_acute = [backend.token_to_id(bytes_to_unicode()[b]) for b in "é".encode()]  # one byte token each
    d = IncrementalDetokenizer(backend, backend.get_vocab_size(), skipped=frozenset({511}))
    assert [d.add(i) for i in (backend.token_to_id("a"), *e_acute, 511, 9999)] == ["a", "", "é", "", ""]
    assert d.text == "aé"


# ---- EOS lookup ------------------------------------------------------------------


def test_eos_from_config_json(ckpt, tmp_path):
    assert Tokenizer.from_dir(ckpt).eos_token_id == 511
    d = checkpoint_copy(ckpt, tmp_path / "c", ("tokenizer.json", "tokenizer_config.json"))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 7}))  # config wins over the rest
    assert Tokenizer.from_dir(d).eos_token_id == 7
    (d / "config.json").write_text(json.dumps({"eos_token_id": [9, 511]}))
    assert Tokenizer.from_dir(d).eos_token_id == 9


def test_eos_falls_back_to_tokenizer_config(ckpt, tmp_path):
    d = checkpoint_copy(ckpt, tmp_path / "c")
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "eos_token_id": None}))
    eos_text = Tokenizer.from_dir(d).id_to_token(5)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_text}))
    assert Tokenizer.from_dir(d).eos_token_id == 5
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos_text, "special": True}}))
    assert Tokenizer.from_dir(d).eos_token_id == 5


def test_eos_falls_back_to_endoftext(ckpt, tmp_path):
    d = checkpoint_copy(ckpt, tmp_path / "c")  # no config.json, no tokenizer_config.json
    assert Tokenizer.from_dir(d).eos_token_id == 511
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<not-in-vocab>"}))
    assert Tokenizer.from_dir(d).eos_token_id == 511


# ---- vocab.json + merges.txt ------------------------------------------------------


@pytest.fixture(scope="module")
def vocab_merges_dir(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("vm")
    tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json")).model.save(str(d))
    # The BPE model saves only learned tokens; GPT-2's real vocab.json also lists <|endoftext|>.
    vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
    vocab[EOS_TOKEN] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return d


def test_vocab_merges_matches_tokenizer_json(tok, vocab_merges_dir):
    assert not (vocab_merges_dir / "tokenizer.json").exists()
    vm = Tokenizer.from_dir(vocab_merges_dir)
    assert vm.vocab_size == tok.vocab_size
    assert vm.eos_token_id == tok.eos_token_id == 511  # found via <|endoftext|>
    for text in list(TEXTS.values()) + [f"a{EOS_TOKEN}b"]:
        assert vm.encode(text) == tok.encode(text), text
        assert vm.decode(vm.encode(text)) == tok.decode(tok.encode(text))
    assert vm.token_bytes == tok.token_bytes
    ids = vm.encode(TEXTS["mixed"]) + [511]
    assert stream(vm, ids)[1] == TEXTS["mixed"]


def test_vocab_merges_without_endoftext_has_no_eos(ckpt, tmp_path):
    tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json")).model.save(str(tmp_path))
    vm = Tokenizer.from_dir(tmp_path)
    assert vm.vocab_size == 511 and vm.eos_token_id is None


# ---- errors ----------------------------------------------------------------------


def test_missing_files_raise_file_not_found(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match="tokenizer.json") as e:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(FileNotFoundError, match="merges.txt"):
        Tokenizer.from_dir(tmp_path / "does-not-exist")
    tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json")).model.save(str(tmp_path))
    (tmp_path / "merges.txt").unlink()  # vocab.json alone is not enough
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("content", ["not json at all", '{"model": {"type": "BPE"', "{}"])
def test_corrupt_tokenizer_json_raises_value_error(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_config_json_raises_value_error(ckpt, tmp_path):
    d = checkpoint_copy(ckpt, tmp_path / "c")
    (d / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json"):
        Tokenizer.from_dir(d)


@pytest.mark.parametrize("content", ["[]", '"eos"', "{oops"])
def test_a_tokenizer_config_that_is_no_object_raises_value_error(ckpt, tmp_path, content):
    """tokenizer_config.json is read for the EOS token and the chat template: both say what is wrong with it."""
    from minfer.text.chat_template import ChatTemplate

    d = checkpoint_copy(ckpt, tmp_path / "c")
    (d / "tokenizer_config.json").write_text(content)
    with pytest.raises(ValueError, match="tokenizer_config.json") as info:
        Tokenizer.from_dir(d)
    assert str(d) in str(info.value)
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        ChatTemplate.from_dir(d, Tokenizer(tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))))


def test_a_sentencepiece_model_alone_is_named(tmp_path):
    """Llama 2's original release ships tokenizer.model only: the error says minfer does not read it."""
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x0b")
    with pytest.raises(FileNotFoundError, match="tokenizer.model .SentencePiece. is not read") as info:
        Tokenizer.from_dir(tmp_path)
    assert "tokenizer.json" in str(info.value) and "\n" not in str(info.value)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
