"""Sampling defaults from a checkpoint's generation_config.json, as vLLM's `--generation-config`.

Model authors ship recommended sampling settings there (Qwen3: temperature 0.6, top_p 0.95,
top_k 20). With `auto` (the default, as in vLLM) a request that leaves a field out gets the
checkpoint's value instead of the API's default; `vllm` ignores the file; a directory reads its
generation_config.json instead of the model's. A field the request sends always wins. The server
applies them to requests, `LLM.generate` to calls that pass no SamplingParams (as vLLM's LLM does).
"""

from __future__ import annotations

import json
from pathlib import Path

from .sampling_params import RULES

# generation_config.json keys that default the request field of the same name
APPLIED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# keys vLLM also applies that minfer does not: reported, never silently dropped
NOT_APPLIED = ("max_new_tokens",)
IGNORE_IT = "(--generation-config vllm ignores the file)"


def sampling_defaults(model_dir: str | Path, setting: str = "auto") -> tuple[dict, list[str]]:
    """({request field: default}, [notes on keys found but not applied]) for the `setting`."""
    if setting == "vllm":
        return {}, []
    path = Path(model_dir if setting == "auto" else setting) / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no generation_config.json in that directory")
        return {}, []
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(config).__name__} {IGNORE_IT}")
    defaults = {key: config[key] for key in APPLIED if config.get(key) is not None}
    for key, value in defaults.items():  # judged as a request's field would be, by the one rule for it
        if not RULES[key].ok(value):
            raise ValueError(f"{path}: {key} must be {RULES[key].must}, got {value!r} {IGNORE_IT}")
    notes = [f"{key}={config[key]!r} (not supported yet)" for key in NOT_APPLIED if config.get(key) is not None]
    return defaults, notes


def with_defaults(body: dict, defaults: dict) -> dict:
    """The request body with the checkpoint's defaults under the fields it omits or sends as null (JSON's "the
    default", which is the checkpoint's here, as in vLLM)."""
    return {**defaults, **{k: v for k, v in body.items() if v is not None or k not in defaults}}


def describe(defaults: dict, notes: list[str], setting: str) -> str:
    """The banner's line on sampling defaults."""
    if setting == "vllm":
        return "sampling defaults: the API's (--generation-config vllm)"
    if not defaults and not notes:
        return "sampling defaults: the API's (no sampling settings in generation_config.json)"
    applied = ", ".join(f"{k}={v!r}" for k, v in defaults.items()) or "none"
    skipped = f"; not applied: {', '.join(notes)}" if notes else ""
    return f"sampling defaults from generation_config.json: {applied}{skipped} (--generation-config vllm: off)"
