"""The compiled-grammar cache is bounded: a server sent a distinct JSON schema per request keeps at most
`capacity` compiled grammars, dropping the least recently used (a leak soak sends thousands)."""

from minfer.engine.structured_outputs_params import StructuredOutputsParams
from minfer.structured.grammars import Grammars
from minfer.text.tokenizer import Tokenizer


def schema(key: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]})


def test_distinct_schemas_keep_only_the_most_recently_used(make_checkpoint):
    tokenizer = Tokenizer.from_dir(make_checkpoint("tiny"))
    grammars = Grammars(tokenizer, tokenizer.vocab_size, capacity=3)
    for i in range(3):
        grammars.compiled(schema(f"k{i}"))
    grammars.compiled(schema("k0"))  # used again: now the most recent, so k1 is the one to go
    assert grammars.num_compiled == 3
    for i in range(3, 10):
        grammars.compiled(schema(f"k{i}"))
        grammars.compiled(schema("k0"))  # kept warm: never compiled again
    assert grammars.num_compiled == 10
    grammars.compiled(schema("k1"))  # dropped long ago: compiled afresh
    assert grammars.num_compiled == 11
    assert [probe(grammars, key) for key in ("k0", "k1", "k9")] == [True] * 3  # the three most recent
    assert not probe(grammars, "k8")  # fell out for k1: three at most


def probe(grammars: Grammars, key: str) -> bool:
    """Whether `key`'s grammar is still kept, read off the compile counter (a kept one compiles nothing)."""
    before = grammars.num_compiled
    grammars.compiled(schema(key))
    return grammars.num_compiled == before
