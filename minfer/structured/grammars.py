"""A request's constraint, compiled: llguidance turns a JSON schema, regex, choice list or grammar into a
matcher that says, at each step, which tokens may come next.

llguidance (a Rust core behind a small Python API; vLLM, SGLang and llama.cpp use it too) is imported
only when a request asks for structured output: a machine without it serves everything else, and a
constrained request there is refused with the command that installs it.

Its tokenizer is built from minfer's own (`Tokenizer.backend`, a `tokenizers.Tokenizer`, as JSON), with
the model's vocabulary size: the mask must be as wide as the logits (Qwen3's 151,936 rows), and the rows
past the tokenizer's last token are never allowed. A compiled grammar is kept (least recently used
first out) as a matcher in its start state; each sequence gets a copy, which costs far less than a
compile.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import asdict

from ..engine.structured_outputs_params import StructuredOutputsParams
from ..errors import InvalidParameter
from ..text.tokenizer import Tokenizer

INSTALL = "pip install llguidance"
# JSON's whitespace between tokens: at most one space, as json.dumps writes it. Unbounded whitespace
# (llguidance's default) lets a model pad forever instead of finishing its object; even a newline and 20
# tabs at every gap took a random model's greedy output past 120 tokens for a two-key object.
JSON_WHITESPACE = r"[ ]?"
MAX_MESSAGE = 600  # characters of llguidance's error message that a 400 quotes
# What llguidance takes in a JSON schema: integers its Python binding can hand over (a 64-bit signed or unsigned
# integer), and number bounds it can write a pattern for (past 10^18 its range patterns fail, one side or both)
INTEGERS = (-(2**63), 2**64 - 1)
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
BOUND_LIMIT = 10**18
RANGE_FAILURE = "Failed to generate regex for"  # llguidance's words for a bound it cannot write a pattern for


def import_llguidance():
    """The llguidance module, or InvalidParameter (a 400) that says how to install it."""
    try:
        import llguidance
    except ImportError:
        raise InvalidParameter(
            "structured_outputs",
            f"structured outputs need the llguidance package, which is not installed here: {INSTALL}",
            "unsupported_parameter",
        ) from None
    return llguidance


def grammar_text(llg, c: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (not yet checked: compiling it says whether it is good)."""
    if c.json is not None or c.json_object:
        schema = c.json if c.json is not None else {"type": "object"}
        lone = next(lone_backslash_patterns(schema), None)
        if lone is not None:
            raise ValueError(f"the pattern {lone!r} ends in a lone backslash, an escape of nothing")
        huge = next(((path, v) for path, v in numbers(schema) if isinstance(v, int) and not within(v, INTEGERS)), None)
        if huge is not None:
            raise ValueError(f"'{huge[0]}' is {huge[1]}, outside the integers the grammar engine takes "
                             f"({INTEGERS[0]} to {INTEGERS[1]})")
        if c.disable_any_whitespace:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        if c.whitespace_pattern is not None:
            whitespace = {"whitespace_pattern": c.whitespace_pattern}
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=whitespace)
        # A default, which the schema's own "x-guidance" settings may change.
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
    if c.regex is not None:
        # llguidance drops a trailing lone backslash (an escape of nothing, an error in every dialect): "a\\" ran as "a"
        if ends_in_lone_backslash(c.regex):
            raise ValueError("it ends in a lone backslash, an escape of nothing")
        return llg.LLMatcher.grammar_from_regex(c.regex)
    if c.choice is not None:
        # One lexeme of all the strings: as alternatives of the start rule (llguidance's "choice"), each was a
        # parser item, and past 2,000 of them a row overflowed after the first token (grammar_dead_end)
        return llg.grammar_from("lark", "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(s) for s in c.choice))
    return llg.grammar_from("grammar", c.grammar)  # Lark, or GBNF (converted to Lark)


def ends_in_lone_backslash(pattern: str) -> bool:
    return (len(pattern) - len(pattern.rstrip("\\"))) % 2 == 1


def within(value, limits: tuple[int, int]) -> bool:
    return limits[0] <= value <= limits[1]


def numbers(schema, path: str = ""):
    """(where, value) for every number in a JSON schema, data (const, enum, ...) included: `where` is a dotted path
    ("properties.x.minimum")."""
    items = enumerate(schema) if isinstance(schema, list) else schema.items() if isinstance(schema, dict) else ()
    for key, value in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield where, value
        else:
            yield from numbers(value, where)


def range_failure(schema, error: str) -> str:
    """llguidance's message, or where it failed to write a bound's pattern, the bound that is out of its range."""
    if RANGE_FAILURE in error:
        for where, value in numbers(schema):
            if where.rpartition(".")[2] in BOUNDS and not -BOUND_LIMIT < value < BOUND_LIMIT:
                return (f"'{where}' is {value}, a bound the grammar engine cannot write a number's pattern for "
                        "(it takes bounds between -10^18 and 10^18)")
    return error


def lone_backslash_patterns(schema):
    """Every regex of a JSON schema (`pattern` values, `patternProperties` keys) that ends in a lone backslash:
    llguidance drops it there too (`"pattern": "\\"` allowed any string). Data (const, enum, ...) is not walked."""
    if isinstance(schema, list):
        for item in schema:
            yield from lone_backslash_patterns(item)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str) and ends_in_lone_backslash(value):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from (k for k in value if ends_in_lone_backslash(k))
            if key not in ("const", "enum", "default", "examples"):
                yield from lone_backslash_patterns(value)


class Grammars:
    """Compiled grammars by constraint, each a matcher in its start state; `matcher()` hands out copies.
    Thread-safe: the server compiles at the edge (its handler threads), the engine copies (its worker)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: the mask is as wide as the logits
        self.capacity = capacity
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self._llg_tokenizer = None  # built on first use: a second or so for a 150k vocabulary
        self.num_compiled = 0

    def matcher(self, c: StructuredOutputsParams):
        """A fresh matcher for `c` (an llguidance LLMatcher); InvalidParameter if `c` does not compile."""
        return self.compiled(c).deep_copy()

    def compiled(self, c: StructuredOutputsParams):
        """The start-state matcher of `c`, compiled now or kept from before. Never advanced: copy it."""
        key = json.dumps(asdict(c), sort_keys=True)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        llg = import_llguidance()
        try:
            text = grammar_text(llg, c)
        except ValueError as e:  # a schema llguidance cannot read, a GBNF grammar it cannot convert
            raise InvalidParameter("structured_outputs", f"the {c.kind} does not compile: {_short(e)}") from None
        matcher = llg.LLMatcher(self.llg_tokenizer(llg), text, log_level=0)  # builds without the GIL
        if matcher.is_error():  # a bad schema, an unsupported keyword, a regex that does not parse
            message = _short(matcher.get_error())
            if c.json is not None:
                message = range_failure(c.json, message)
            raise InvalidParameter("structured_outputs", f"the {c.kind} does not compile: {message}")
        probe = matcher.deep_copy()  # its first mask: a constraint nothing can start ([^\x00-\x{10FFFF}]) errs
        probe.compute_bitmask()
        if probe.is_error():
            reason = probe.get_error().splitlines()[0]
            raise InvalidParameter("structured_outputs", f"the {c.kind} allows no text at all ({reason})")
        with self._lock:
            self._compiled[key] = matcher
            self.num_compiled += 1
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return matcher

    def llg_tokenizer(self, llg):
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = build_llg_tokenizer(llg, self.tokenizer, self.vocab_size)
            return self._llg_tokenizer


def build_llg_tokenizer(llg, tokenizer: Tokenizer, vocab_size: int):
    """llguidance's tokenizer from minfer's: the same `tokenizers` JSON (tokenizer.json, or the one rebuilt
    from vocab.json + merges.txt), without padding or truncation, its mask `vocab_size` wide, every id
    that ends a generation counted as its end of sentence."""
    backend = type(tokenizer.backend).from_str(tokenizer.backend.to_str())  # a copy: ours keeps its settings
    backend.no_padding()
    backend.no_truncation()
    return llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_ids or None)


def _short(error) -> str:
    """The first lines of llguidance's message (it goes on with the parser's state)."""
    text = str(error).strip()
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."
