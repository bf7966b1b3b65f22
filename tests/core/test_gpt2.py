"""minfer's GPT-2 against transformers' GPT2LMHeadModel on the same random checkpoints."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from engine_checks import greedy_without_cache

from minfer.models.gpt2 import GPT2

transformers = pytest.importorskip("transformers")

SHAPES = {
    "tiny": {},  # 2 layers, 4 heads of 16
    "six-heads": dict(n_embd=72, n_head=6, n_layer=3, vocab_size=400, n_positions=128),  # not a power of two
}


def load_pair(make_checkpoint, shape, layout, device):
    """Ours on the test device (conftest.py), transformers' on the CPU."""
    path = make_checkpoint("tiny", layout, seed=1, **SHAPES[shape])
    ours = GPT2.from_pretrained(path, device=device)
    ref = transformers.GPT2LMHeadModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    return ours, ref


@pytest.mark.parametrize("layout", ["hub", "transformers"])
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.inference_mode()
def test_logits_match_transformers(make_checkpoint, shape, layout, device):
    ours, ref = load_pair(make_checkpoint, shape, layout, device)
    vocab = ours.config.vocab_size
    ids = torch.randint(0, vocab, (3, 50), generator=torch.Generator().manual_seed(0))
    logits = ours(ids.to(device)).cpu()
    expected = ref(ids).logits
    assert logits.shape == (3, 50, vocab)
    assert logits.std() > 0.05  # random weights, but not a degenerate all-equal output
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["hub", "transformers"])
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.inference_mode()
def test_greedy_continuation_matches_transformers(make_checkpoint, shape, layout, device):
    ours, ref = load_pair(make_checkpoint, shape, layout, device)
    prompt = torch.randint(0, ours.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    got = greedy_without_cache(ours, prompt, 32)
    expected = ref.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
        pad_token_id=0,
    )
    assert torch.equal(got, expected)
    assert len(set(got[0, 7:].tolist())) > 1  # the continuation is not a single repeated token


def test_config_drives_the_shape(make_checkpoint):
    model = GPT2.from_pretrained(make_checkpoint("tiny", "hub", seed=1, **SHAPES["six-heads"]))
    cfg = model.config
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.head_dim) == (3, 6, 72, 12)
    assert len(model.h) == 3 and model.wpe.weight.shape == (128, 72)
    n_params = sum(p.numel() for p in model.parameters())
    C, V, P, L = 72, 400, 128, 3
    assert n_params == V * C + P * C + L * (12 * C * C + 13 * C) + 2 * C


def test_lm_head_is_tied_to_embedding(tiny_checkpoint, device):
    model = GPT2.from_pretrained(tiny_checkpoint, device=device)
    ids = torch.tensor([[1, 2, 3]], device=device)
    with torch.inference_mode():
        logits = model(ids)
        x = model.wte(ids) + model.wpe(torch.arange(3, device=device))
        for block in model.h:
            x = block(x)
        manual = model.ln_f(x) @ model.wte.weight.T
    torch.testing.assert_close(logits, manual)
    assert model.lm_head.weight is model.wte.weight  # one parameter, not a copy


def with_lm_head(path, out, tied: bool, head: str):
    """A copy of the checkpoint at `path` whose config.json says `tied`, storing lm_head.weight too: a copy of the
    embedding (head "copy") or a matrix of its own ("own"). transformers stores it as nn.Linear does, [V, C]."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": tied}))
    tensors = load_file(str(out / "model.safetensors"))
    wte = next(tensor for name, tensor in tensors.items() if name.endswith("wte.weight"))
    tensors["lm_head.weight"] = wte.clone() if head == "copy" else torch.randn_like(wte)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("layout", ["hub", "transformers"])
@pytest.mark.parametrize("tied, head", [(True, "copy"), (True, "own"), (False, "own")])
@torch.inference_mode()
def test_a_stored_lm_head_loads_as_transformers_loads_it(make_checkpoint, tmp_path, caplog, layout, tied, head):
    """A tied config.json with the embedding's copy stored: tied. A head of its own: kept apart, as transformers
    keeps it; where config.json says tied, with a warning that says why (transformers warns too)."""
    d = with_lm_head(make_checkpoint("tiny", layout, seed=1), tmp_path / "ck", tied, head)
    with caplog.at_level("WARNING", logger="minfer"):
        ours = GPT2.from_pretrained(d)
    ref = transformers.GPT2LMHeadModel.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=0)
    assert (ours.lm_head.weight is ours.wte.weight) == (head == "copy") == ours.config.tie_word_embeddings
    warned = [r.getMessage() for r in caplog.records if r.name == "minfer" and "lm_head.weight" in r.getMessage()]
    assert len(warned) == (1 if tied and head == "own" else 0), caplog.text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_runs(tiny_checkpoint, dtype, device):
    model = GPT2.from_pretrained(tiny_checkpoint, device=device, dtype=dtype)
    ref = GPT2.from_pretrained(tiny_checkpoint, device=device)
    assert model.dtype == dtype and all(p.dtype == dtype for p in model.parameters())
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        low, full = model(ids).float(), ref(ids)
    assert (low - full).abs().max() < 0.1


def test_too_long_input_is_refused(tiny_checkpoint, device):
    model = GPT2.from_pretrained(tiny_checkpoint, device=device)
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        model(torch.zeros(1, 513, dtype=torch.long, device=device))
