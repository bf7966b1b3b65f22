"""Every architecture satisfies the model contract (models/contract.py), as code and in a real flat forward."""

import pytest
import torch

from minfer.attention.kv_cache import KVCache, slot_of
from minfer.attention.backend import StepLayout
from minfer.attention.paged import PagedBatch
from minfer.assembly.selector import choose_attention_backend
from minfer.models.contract import Architecture, CausalLM
from minfer.models.gpt2 import GPT2
from minfer.models.llama import Llama
from minfer.models.registry import ARCHITECTURES, load_model

PRESETS = ["tiny", "qwen3-tiny", "llama-tiny"]


def test_every_registered_class_is_an_architecture():
    for name, model_class in ARCHITECTURES.items():
        assert isinstance(model_class, Architecture), name


def test_a_plain_module_is_not_a_causal_lm():
    assert not isinstance(torch.nn.Linear(2, 2), CausalLM)


@pytest.mark.parametrize("preset", PRESETS)
def test_loaded_models_keep_the_contract(make_checkpoint, preset):
    path = make_checkpoint(preset)
    model = load_model(path)
    # Each member as callers reach it: from Python 3.12, isinstance on a runtime Protocol looks attributes up
    # statically, which an nn.Module's submodules (lm_head, in _modules) escape (it failed on the GPU's 3.12)
    members = [*CausalLM.__annotations__, *(name for name in vars(CausalLM) if not name.startswith("_"))]
    assert {"config", "lm_head", "forward"} <= set(members) and all(hasattr(model, m) for m in members)
    assert type(model) in (GPT2, Llama)
    assert model.model_dir == path  # a real attribute, set by the constructor
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    config = model.config
    for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_positions"):
        assert isinstance(getattr(config, name), int) and getattr(config, name) > 0, name
    assert model.lm_head.weight.shape == (config.vocab_size, model.lm_head.in_features)


@pytest.mark.parametrize("preset", PRESETS)
@torch.inference_mode()
def test_the_flat_engine_forward_equals_the_plain_one(make_checkpoint, preset):
    """Two steps of two sequences on scattered blocks: (N,) token ids in, (S, V) logits out."""
    model = load_model(make_checkpoint(preset))
    block_size, null = 4, 12
    cache = KVCache(model.config, num_blocks=null, block_size=block_size, device="cpu", dtype=torch.float32)
    backend = choose_attention_backend("cpu", torch.float32, "eager")  # the "slots" cache above
    tables = [[7, 2, 9, 4], [11, 0, 5]]  # sequence 0 grows to 13 tokens, sequence 1 to 10
    prompts = [
        torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 10)
    ]

    def step(chunks: list[tuple[int, int, int]]) -> torch.Tensor:  # chunks: (sequence, start, end)
        ids = torch.cat([prompts[i][a:b] for i, a, b in chunks])  # (N,)
        positions = torch.cat([torch.arange(a, b) for _, a, b in chunks])  # (N,)
        slots = torch.cat([slot_of(torch.tensor(tables[i]), torch.arange(a, b), block_size) for i, a, b in chunks])
        starts = torch.tensor([0] + [b - a for _, a, b in chunks]).cumsum(0).tolist()
        layout = StepLayout(
            slots,
            starts[:-1],
            [b - a for _, a, b in chunks],
            [b for _, _, b in chunks],
            [tables[i] for i, _, _ in chunks],
            block_size,
            null,
        )
        batch = PagedBatch(positions, cache, backend.build_metadata(layout), torch.tensor(starts[1:]) - 1)
        logits = model(ids, batch)  # the last row of each chunk samples
        assert logits.shape == (len(chunks), model.config.vocab_size)
        return logits

    first = step([(0, 0, 12), (1, 0, 6)])  # two fresh prompts
    second = step([(0, 12, 13), (1, 6, 10)])  # a decode next to a continued prompt
    for logits, ends in ((first, (12, 6)), (second, (13, 10))):
        for i, end in enumerate(ends):
            plain = model(prompts[i][None, :end])[0, -1]  # (V,): the plain (B, T) forward's last position
            torch.testing.assert_close(logits[i], plain, atol=1e-4, rtol=1e-4)
