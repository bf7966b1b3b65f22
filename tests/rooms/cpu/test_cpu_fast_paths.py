"""CPU fast paths compute what the plain ops compute, with bounded memory."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minfer.cpu import tiled_attention as cpu_tiled
from minfer.cpu.tiled_attention import ContextReader
from minfer.cpu import linears as cpu_linears
from minfer.cpu.linears import optimize_for_cpu
from minfer.cpu.packing import LMHead, PackedLinear, SplitRowLinear, padded_rows

needs_packing = pytest.mark.skipif(
    not cpu_linears.packing_available(torch.float32),
    reason="this torch build has no oneDNN (mkldnn) to pack weights with",
)


def test_row_counts_are_rounded_to_a_few_sizes():
    """oneDNN caches a kernel per shape: the sizes a server sees must collapse to a handful."""
    sizes = {padded_rows(n) for n in range(1, 1025)}
    assert len(sizes) <= 45
    assert all(n <= padded_rows(n) <= 1.25 * n for n in range(1, 1025))
    assert all(padded_rows(n) == n for n in range(1, 17))  # decode batches up to 16: no padding at all


@needs_packing
@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (17, 24), (70, 24), (2, 9, 24)])
def test_packed_linear_equals_nn_linear(shape):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    x = torch.randn(*shape)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x))


@needs_packing
@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_one_row_split_along_the_input_equals_nn_linear(parts, bias):
    """One row runs on the copy split into `parts` along the input (partial rows summed, the bias once);
    more rows, and a width the parts do not divide, run packed."""
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    packed = cpu_linears.packed_for(linear, parts)
    assert type(packed) is SplitRowLinear and packed.split_weight.shape == (parts, 24 // parts, 40)
    for shape in [(1, 24), (24,), (1, 1, 24), (3, 24)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), linear(x))
    assert type(cpu_linears.packed_for(nn.Linear(25, 8), 2)) is PackedLinear


@needs_packing
def test_one_row_copies_only_in_fp32_with_threads_memory_to_spare_and_weights_beyond_the_caches(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 12))  # 384 bytes of weight
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(cpu_linears, "available_memory", lambda device: 4 * 384)
    assert cpu_linears.one_row_parts(model, torch.float32) == 1  # a few bytes stay cached: no copy
    monkeypatch.setattr(cpu_linears, "SPLIT_ROW_MIN_BYTES", 384)
    assert cpu_linears.one_row_parts(model, torch.float32) == 4
    assert cpu_linears.one_row_parts(model, torch.bfloat16) == 1
    monkeypatch.setattr(cpu_linears, "available_memory", lambda device: 4 * 384 - 1)  # the copy would not fit
    assert cpu_linears.one_row_parts(model, torch.float32) == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert cpu_linears.one_row_parts(model, torch.float32) == 1


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_lm_head_equals_the_tied_matmul(rows):
    torch.manual_seed(0)
    wte = torch.randn(101, 16)  # a vocabulary that does not split evenly across threads
    x = torch.randn(rows, 16)
    torch.testing.assert_close(LMHead(wte)(x), F.linear(x, wte))


def test_optimize_for_cpu_swaps_every_linear_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Sequential(nn.Linear(12, 8)))
    x = torch.randn(3, 8)
    expected = model(x)
    optimize_for_cpu(model)
    assert not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(model(x), expected)


@needs_packing
def test_small_linears_stay_plain_and_large_ones_are_packed(monkeypatch):
    """A packed call costs more than F.linear's: a weight below PACK_MIN_WEIGHTS would not win it back."""
    monkeypatch.setattr(cpu_linears, "PACK_MIN_WEIGHTS", 64 * 32)  # the tests' own minimum is 0 (conftest.py)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 63))  # exactly the minimum, one row fewer
    optimize_for_cpu(model)
    assert isinstance(model[0], PackedLinear) and type(model[1]) is nn.Linear


@needs_packing
def test_optimize_for_cpu_gives_a_tied_lm_head_its_own_copy(tiny_checkpoint):
    from minfer.models.gpt2 import GPT2


    model = GPT2.from_pretrained(tiny_checkpoint)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        expected = model(ids)
        optimize_for_cpu(model)
        optimize_for_cpu(model)  # the second call finds nothing left to swap
        assert type(model.lm_head) is LMHead and type(model.h[0].attn.c_attn) is PackedLinear
        assert model.wte.weight.layout == torch.strided  # the input embedding keeps its plain matrix
        torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=1e-4)


def test_context_reader_upcasts_bf16_and_keeps_its_buffers():
    kv_cache = torch.randn(64, 2, 2, 4).bfloat16()  # (slots, key/value, H, D)
    slots = torch.tensor([[5, 6, 7], [40, 41, 0]])
    reader = ContextReader()
    kv = reader.read(kv_cache, slots)
    assert kv.dtype == torch.float32 and kv.shape == (2, 3, 2, 2, 4)  # (seqs, positions, key/value, H, D)
    torch.testing.assert_close(kv, kv_cache[slots].float())
    size = reader.largest_buffer_bytes
    reader.read(kv_cache, slots[:1])  # smaller reads reuse the buffer: nothing new is allocated
    assert reader.largest_buffer_bytes == size


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])  # plain and grouped-query attention
@pytest.mark.parametrize("T, L", [(1, 1), (70, 70), (70, 100), (3, 100)])  # fresh prompts and chunks after context
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_by_matmuls_equals_sdpa(monkeypatch, heads, kv_heads, T, L, dtype):
    """The queries are the last T of L positions; a small tile forces several query blocks (32 rows each)."""
    monkeypatch.setattr(cpu_tiled, "tile_bytes", lambda: 1024)
    torch.manual_seed(0)
    q = torch.randn(T, heads, 16).to(dtype).transpose(0, 1)  # (H, T, D), strided like the engine's
    k, v = torch.randn(2, L, kv_heads, 16).to(dtype).transpose(1, 2)  # 2 x (Hkv, L, D)
    mask = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]  # (T, L) causal
    kf, vf = (x.float().repeat_interleave(heads // kv_heads, dim=0) for x in (k, v))
    expected = F.scaled_dot_product_attention(q.float(), kf, vf, attn_mask=mask, scale=0.25)
    out = cpu_tiled.causal_attention_by_matmuls(q, k, v, scale=0.25)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = {} if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # bf16: the output's rounding
    torch.testing.assert_close(out.float(), expected, **tolerance)


@needs_packing
def test_an_engine_with_one_row_copies_generates_what_one_without_does(monkeypatch, tiny_checkpoint):
    """Batch-1 decode steps on the split copies, batches packed: greedy tokens as without the copies."""
    from minfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["Hello there", "One two three four"]
    plain = LLM(tiny_checkpoint)
    want = [o.token_ids for o in plain.generate(prompts, params)] + [plain.generate(prompts[:1], params)[0].token_ids]
    monkeypatch.setattr(cpu_linears, "one_row_parts", lambda model, dtype: 2)
    split = LLM(tiny_checkpoint)
    assert any(type(m) is SplitRowLinear for m in split.model.modules())
    got = [o.token_ids for o in split.generate(prompts, params)] + [split.generate(prompts[:1], params)[0].token_ids]
    assert got == want

