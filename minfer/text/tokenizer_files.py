"""A checkpoint's tokenizer files: tokenizer.json, or else GPT-2's vocab.json + merges.txt, and the ids that
end a generation (config.json, generation_config.json, tokenizer_config.json)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from ..errors import is_int

EOS_TOKEN = "<|endoftext|>"  # GPT-2's end of text: the EOS of last resort

log = logging.getLogger("minfer")


def read_backend(model_dir: str | Path) -> tokenizers.Tokenizer:
    """The `tokenizers` tokenizer of a checkpoint directory: its tokenizer.json, or else one rebuilt from
    vocab.json and merges.txt."""
    d = Path(model_dir)
    tok_json, vocab, merges = d / "tokenizer.json", d / "vocab.json", d / "merges.txt"
    if tok_json.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(tok_json))
        except Exception as e:  # tokenizers raises a bare Exception on bad input
            raise ValueError(f"{tok_json} is not a valid tokenizer.json ({e}).") from None
    if vocab.is_file() and merges.is_file():
        return _from_vocab_merges(vocab, merges)
    if (d / "tokenizer.model").is_file():  # Llama 2's original release, say
        raise FileNotFoundError(
            f"no tokenizer.json in {d}: its tokenizer.model (SentencePiece) is not read by minfer; transformers "
            "writes a tokenizer.json: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        )
    raise FileNotFoundError(f"no tokenizer found in {d}: looked for tokenizer.json, or vocab.json with merges.txt.")


def tokenizer_file(model_dir: str | Path) -> Path:
    """The file read_backend reads the vocabulary from: tokenizer.json, or else vocab.json."""
    d = Path(model_dir)
    return d / "tokenizer.json" if (d / "tokenizer.json").is_file() else d / "vocab.json"


def check_fits_model(backend: tokenizers.Tokenizer, vocab_size: int, model_dir: str | Path) -> None:
    """Every id the tokenizer writes text in must have a row in the model's embedding (config.json's vocab_size;
    more rows than tokens is fine: Qwen3 pads 151,669 tokens to 151,936). A vocabulary past it is another model's
    tokenizer: ValueError. Added tokens past it (a pad token added without growing the embedding) only cannot be
    used: a warning names them, and a prompt that holds one is refused (engine/request_check.py)."""
    file, config = tokenizer_file(model_dir), Path(model_dir) / "config.json"
    size = max(backend.get_vocab(with_added_tokens=False).values(), default=-1) + 1
    if size > vocab_size:
        raise ValueError(f"{file} holds {size} tokens, but {config} gives the model {vocab_size} (vocab_size): it "
                         "cannot embed the rest; is the tokenizer another model's?")
    beyond = sorted((i, t.content) for i, t in backend.get_added_tokens_decoder().items() if i >= vocab_size)
    if beyond:
        named = ", ".join(f"{content!r} (id {i})" for i, content in beyond[:5]) + (", ..." if len(beyond) > 5 else "")
        log.warning("minfer: %s adds %d token(s) past the %d the model embeds (%s's vocab_size): %s; the model never "
                    "writes them, and a prompt that holds one is refused", file, len(beyond), vocab_size, config, named)


def _from_vocab_merges(vocab: Path, merges: Path) -> tokenizers.Tokenizer:
    """GPT-2's tokenizer from the original OpenAI-style files."""
    try:
        bpe = models.BPE.from_file(str(vocab), str(merges))
    except Exception as e:
        raise ValueError(f"cannot build a BPE tokenizer from {vocab} and {merges} ({e}).") from None
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if backend.token_to_id(EOS_TOKEN) is not None:
        # Special, so the literal text "<|endoftext|>" maps to the one id and decode() skips it.
        backend.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    return backend


def read_eos_token_ids(model_dir: str | Path) -> list[int]:
    """Every end-of-sequence id the checkpoint names: config.json's eos_token_id, then
    generation_config.json's (either may be one id or a list; chat models list their
    end-of-turn token there too). The one place EOS ids are parsed."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{path} is not a valid JSON object: {e}") from None
        for i in eos if isinstance(eos, list) else [eos]:
            if is_int(i) and i >= 0 and i not in ids:
                ids.append(i)
    return ids


def find_eos_ids(model_dir: str | Path, backend: tokenizers.Tokenizer) -> list[int]:
    """The ids config.json and generation_config.json name come first (the first is the EOS);
    then tokenizer_config.json's eos_token; failing all of them, GPT-2's usual token."""
    d = Path(model_dir)
    ids = read_eos_token_ids(d)
    eos = token_text(read_tokenizer_config(d).get("eos_token"))
    if eos is not None and backend.token_to_id(eos) is not None and backend.token_to_id(eos) not in ids:
        ids.append(backend.token_to_id(eos))
    if not ids and backend.token_to_id(EOS_TOKEN) is not None:
        ids.append(backend.token_to_id(EOS_TOKEN))
    return ids


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict (its content)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(model_dir: str | Path) -> dict:
    """tokenizer_config.json's contents ({} where there is none): its EOS token, its chat template."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(config).__name__}")
    return config
