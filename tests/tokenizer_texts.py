"""What the tokenizer tests share: texts whose characters split across tokens (CJK, emoji, accents,
whitespace), and a detokenizer's streamed pieces of a list of ids."""

from minfer.text.tokenizer import Tokenizer

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog 0123456789.",
    "cjk": "日本語のテキストと中文字符，한국어도 있습니다。",
    "emoji": "👩‍💻 codes; flags 🇯🇵🇫🇷🏳️‍🌈, thumbs 👍🏽, family 👨‍👩‍👧‍👦 🤖",
    "accented": "Café naïve façade Ångström Dvořák ñandú Øresund żółć",
    "whitespace": "  leading\tand\ttabs\n\nnewlines\r\n \u00a0 nbsp  trailing   \n",
    "mixed": "GPT-2 says: 你好 🌍! naïve\n\tcode 👩‍💻 ok\n",
    "empty": "",
}


def stream(tok: Tokenizer, ids) -> tuple[list[str], str]:
    d = tok.detokenizer()
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    return pieces, "".join(pieces)
