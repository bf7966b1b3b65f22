"""Stage 05: text <-> token ids, and streaming text out one token at a time.

GPT-2's tokenizer is byte-level BPE: text becomes UTF-8 bytes, bytes are merged
into tokens. So one token can hold half a character, and decoding tokens one
by one shows broken characters (U+FFFD). Llama 2's kind (SentencePiece-style)
spells a character it does not know in byte tokens (<0xE6><0x97><0xA5>).
minfer's IncrementalDetokenizer, on the `tokenizers` library's DecodeStream,
holds incomplete text back until later tokens complete it, for either kind.

    python tutorials/05_tokenizer_streaming.py   # MINFER_MODEL=/path to choose the checkpoint
"""

import tempfile

from _common import model_path, section

from minfer import LLM, SamplingParams
from minfer.checkpoints import write_random_checkpoint
from minfer.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not valid UTF-8

path = model_path()
tok = Tokenizer.from_dir(path)

section("encode and decode")
text = "Hello world! Streaming text, one token at a time."
ids = tok.encode(text)
print(f"vocabulary: {tok.vocab_size:,} tokens; EOS is id {tok.eos_token_id} {tok.id_to_token(tok.eos_token_id)!r}")
print(f"{text!r}\n -> {len(ids)} ids {ids[:12]}{' ...' if len(ids) > 12 else ''}")
print(f" -> tokens {[tok.id_to_token(i) for i in ids[:12]]}")
print("    ('Ġ' is how byte-level BPE writes a space: every byte gets a printable stand-in)")
assert tok.decode(ids) == text
assert tok.decode(tok.encode("<|endoftext|>")) == "", "EOS is a special token: decode() skips it"

section("a character split across tokens")
samples = {
    "CJK": "日本語のテキストと中文字符，한국어도 있습니다。",
    "emoji": "Robots 🤖 and rockets 🚀 and flags 🇯🇵 and 👍🏽.",
    "accents": "Crème brûlée, naïve façade, Ελληνικά, кириллица.",
}


def whole_characters(data: bytes) -> bool:
    """True if the bytes are complete UTF-8 characters."""
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


split_case = None
for name, text in samples.items():
    ids = tok.encode(text)
    assert tok.decode(ids) == text, "byte-level BPE round-trips any text"
    broken = [k for k, i in enumerate(ids) if not whole_characters(tok.token_bytes[i])]  # token_bytes[id]: its bytes
    print(
        f"{name:>7}: {len(text)} characters, {len(text.encode())} bytes, {len(ids)} tokens, "
        f"{len(broken)} tokens that are not whole characters on their own"
    )
    if broken and split_case is None:
        split_case = (name, text, ids, broken[0])
assert split_case is not None, "none of the sample texts splits a character across tokens"

name, text, ids, first = split_case
last = first  # tokens before `first` are whole characters, so `first` starts one: extend to its end
while not whole_characters(b"".join(tok.token_bytes[i] for i in ids[first : last + 1])):
    last += 1
span = [tok.token_bytes[i] for i in ids[first : last + 1]]
print(
    f"\nin the {name} text, tokens {first}..{last} carry the bytes "
    f"{' + '.join(map(repr, span))} = {b''.join(span).decode()!r}"
)

section("streaming, the naive way: decode each token on its own")
naive = "".join(tok.decode([i]) for i in ids)
print(f"{naive!r}")
assert REPLACEMENT in naive and naive != text

section("streaming with IncrementalDetokenizer")
detok = tok.detokenizer()
stream = []
for i in ids:
    piece = detok.add(i)  # '' while a character is incomplete, then the whole character
    stream.append(piece)
stream.append(detok.flush())
print("pieces: " + " | ".join(repr(p) for p in stream[:24]) + (" ..." if len(stream) > 24 else ""))
held = sum(1 for p in stream[:-1] if p == "")
print(f"{held} steps emitted nothing: their bytes waited for the next token")
assert "".join(stream) == tok.decode(ids) == text
assert not any(REPLACEMENT in p for p in stream), "valid text never shows U+FFFD mid-stream"
assert held > 0

for name, text in samples.items():  # every sample, not just the one shown
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in tok.encode(text)] + [detok.flush()]
    assert "".join(pieces) == text and not any(REPLACEMENT in p for p in pieces), name
print("every sample text streams to exactly its decode(), with no U+FFFD")

section("streaming what a model generates")
# Generated tokens need not be valid UTF-8 (a random model's rarely are). The contract then:
# the stream still ends up equal to decode(), which shows U+FFFD where decode() would.
llm = LLM(path, num_kv_blocks=16, max_num_seqs=1)
generated = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, seed=0, ignore_eos=True), use_tqdm=False)[
    0
]
detok = tok.detokenizer()
streamed = "".join(detok.add(i) for i in generated.token_ids) + detok.flush()
print(f"{len(generated.token_ids)} generated tokens -> {streamed!r}")
assert streamed == tok.decode(generated.token_ids) == generated.text

section("a SentencePiece-style tokenizer (Llama 2's kind)")
# A random Llama 2-style checkpoint: <unk> <s> </s>, 256 byte tokens, then pieces; `▁` stands for a space.
scratch = tempfile.TemporaryDirectory(prefix="minfer-llama2-tiny-")  # removed when the script ends
sp_path = write_random_checkpoint(scratch.name, "llama2-tiny")
sp = Tokenizer.from_dir(sp_path)
text = "Hello 日本 world\n"
ids = sp.encode_prompt(text)
print(f"{text!r} -> {[sp.id_to_token(i) for i in ids]}")
print("    (<s> starts a prompt; '▁' is a space; 日本 and the newline are spelt in byte tokens: byte fallback)")
assert sp.id_to_token(ids[0]) == "<s>" and sp.decode(ids) == text
detok = sp.detokenizer()
pieces = [detok.add(i) for i in ids] + [detok.flush()]
print("pieces: " + " | ".join(repr(p) for p in pieces))
# A run of bytes comes out whole with the token that ends it, or, last in the stream, at flush().
assert "".join(pieces) == text and any(p.startswith("日本") for p in pieces) and pieces[-1] == "\n"

# A run of byte tokens waits for its end: one invalid byte later makes decode() show every byte of
# the run as U+FFFD, even the ones that were a whole character so far.
a, ff, w = sp.token_to_id("<0x41>"), sp.token_to_id("<0xFF>"), sp.token_to_id("▁w")
print(f"decode(<0x41>) = {sp.decode([a])!r}, but decode(<0x41> <0xFF> ▁w) = {sp.decode([a, ff, w])!r}")
detok = sp.detokenizer()
pieces = [detok.add(i) for i in (a, ff, w)] + [detok.flush()]
print("pieces: " + " | ".join(repr(p) for p in pieces))
assert pieces == ["", "", "\ufffd\ufffd w", ""] and "".join(pieces) == sp.decode([a, ff, w])

# A random model writes byte tokens half the time: the stream still ends up equal to decode().
sp_llm = LLM(str(sp_path), num_kv_blocks=16, max_num_seqs=1)
generated = sp_llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, seed=0, ignore_eos=True),
                            use_tqdm=False)[0]
detok = sp.detokenizer()
streamed = "".join(detok.add(i) for i in generated.token_ids) + detok.flush()
print(f"{len(generated.token_ids)} generated tokens -> {streamed!r}")
assert streamed == sp.decode(generated.token_ids) == generated.text
print("\nOK: round trips, a split character held back and emitted whole, streaming equals decode(), for both kinds.")
