"""The compiled attention backend (compiled/attention.py): the same results as eager attention,
no recompiles while serving, and a clean fall back to eager when it cannot run."""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from engine_checks import generate_varied_batches

from minfer import LLM, SamplingParams
from minfer.compiled import attention as compiled_module
from minfer.assembly import selector
from minfer.cpu import tiled_attention as cpu_tiled
from minfer.compiled.attention import CompiledBackend, paged_decode_attention
from minfer.cpu.tiled_attention import CPUTiledBackend
from minfer.attention.kv_cache import KVCache, slot_of
from minfer.compiled.attention import BlockedKVCache, slots_to_blocks, store_kv_without_views
from minfer.attention.backend import StepLayout
from minfer.assembly import prepare
from minfer.models.registry import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def random_case(S, H, Hkv, D, dtype, seed=0, block_size=16, num_blocks=64):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3 * block_size, (S,), generator=g).tolist()
    cache = torch.randn((num_blocks + 1) * block_size, 2, Hkv, D, generator=g).to(dtype)
    cache[num_blocks * block_size :] = 0
    tables = torch.randperm(num_blocks, generator=g)[: 3 * S].view(S, 3).tolist()
    layout = StepLayout(torch.zeros(S, dtype=torch.long), list(range(S)), [1] * S, lens, tables, block_size, num_blocks)
    q = torch.randn(S, H, D, generator=g).to(dtype)
    return q, cache, layout


@pytest.mark.parametrize("H, Hkv", [(4, 4), (8, 2), (3, 3)])  # GPT-2-like, grouped-query, odd heads
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("amx", [False, True])  # on an AMX CPU a lone short sequence is read by gather + sdpa
def test_kernel_matches_eager(monkeypatch, H, Hkv, dtype, tolerance, amx):
    """The same keys and values, the compiled backend's in blocks, the eager one's in rows of slots."""
    monkeypatch.setattr(cpu_tiled, "cpu_has_amx", lambda: amx)
    # torch.compile, as with the compile cache off: a precompile per head shape, not hitting Inductor's cache,
    # cost the suite ~80 s whenever the compiled room changed. The engine tests check the cache's graphs.
    monkeypatch.setenv("MINFER_CACHE", "off")
    compiled, eager = CompiledBackend("cpu", dtype), CPUTiledBackend("cpu", dtype)
    assert (compiled.lone_eager_max_context > 0) == amx
    # As the engine does: warm_up compiles with duck sizing off. Compiled on first call instead, in some
    # orders of these cases (as pytest-xdist deals them), Inductor's kernel corrupted the heap.
    assert compiled.warm_up(H, Hkv, 16, budget_s=600) is None  # the kernel's results, not the start-up's budget
    for S in (1, 2, 7):
        q, cache, layout = random_case(S, H, Hkv, 16, dtype, seed=S)
        blocks = slots_to_blocks(cache, layout.block_size)
        compiled.block_size = layout.block_size
        seqs = list(range(S))
        with torch.inference_mode():
            group = compiled.decode_group(layout, seqs)
            assert (group.slots is not None) == (amx and S == 1)  # gathered, not the compiled kernel
            got = compiled.decode_attention(q, blocks, group, 0.25)
            want = eager.decode_attention(q, cache, eager.decode_group(layout, seqs), 0.25)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_the_plain_function_is_attention():
    """Uncompiled, the lesson's function is softmax(q k^T) v over each sequence's own context."""
    q, cache, layout = random_case(3, 4, 2, 8, torch.float32)
    group = CompiledBackend("cpu", torch.float32).decode_group(layout, [0, 1, 2])
    out = paged_decode_attention(q, slots_to_blocks(cache, 16), group.tables, group.lens, 0.5, 16)
    for i, L in enumerate(layout.context_lens):
        kv = cache[[slot_of(layout.block_tables[i], p, 16) for p in range(L)]]  # (L, 2, Hkv, D)
        k, v = kv[:, 0].repeat_interleave(2, dim=1), kv[:, 1].repeat_interleave(2, dim=1)  # (L, H, D)
        weights = torch.softmax((q[i][None] * k).sum(-1) * 0.5, dim=0)  # (L, H)
        torch.testing.assert_close(out[i], (weights[..., None] * v).sum(0))


@pytest.mark.parametrize("Hkv, D, B", [(2, 8, 4), (3, 16, 16)])
@pytest.mark.parametrize("amx", [False, True])  # prefill context for matmuls, or for sdpa (keys in rows)
def test_the_block_layout_stores_and_reads_what_the_slot_layout_does(monkeypatch, Hkv, D, B, amx):
    """KV writes, prefill context reads and copy-on-write, in blocks (transposed keys) and in rows of
    slots: the same keys and values come back. A package's graph writes with store_kv_without_views, into a
    layer's cache of its own: the same again."""
    monkeypatch.setattr(cpu_tiled, "cpu_has_amx", lambda: amx)
    config = SimpleNamespace(num_layers=2, num_kv_heads=Hkv, head_dim=D, max_positions=64)
    rows, blocks = KVCache(config, 6, B, "cpu", torch.float32), BlockedKVCache(config, 6, B, "cpu", torch.float32)
    assert blocks.k.shape == (2, 7, Hkv, D, B) and blocks.v.shape == (2, 7, Hkv, B, D)
    assert not blocks.kv[:, 6].any()  # the null block is zeroed
    eager, compiled = CPUTiledBackend("cpu", torch.float32), CompiledBackend("cpu", torch.float32)
    compiled.block_size = B
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(6 * B, generator=g)  # every slot but the null block's, in random order
    for layer in range(2):
        k, v = torch.randn(2, 6 * B, Hkv, D, generator=g)
        eager.write_kv(rows.kv[layer], slots, k, v)
        compiled.write_kv(blocks.kv[layer], slots, k, v)
        own = torch.zeros_like(blocks.kv[layer])  # not a view: as a package's graph has a layer's cache
        store_kv_without_views(own, slots, k, v, B)
        torch.testing.assert_close(own[:6], blocks.kv[layer, :6], rtol=0, atol=0)
    torch.testing.assert_close(slots_to_blocks(rows.kv, B), blocks.kv, rtol=0, atol=0)
    context = torch.tensor([slot_of([4, 1, 3], p, B) for p in range(2 * B + 1)])  # a sequence's blocks 4, 1, 3
    for got, want in zip(compiled.chunk_context(blocks.kv[1], context), eager.chunk_context(rows.kv[1], context)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # keys, then values: (Hkv, L, D) each
    for cache in (rows, blocks):
        cache.copy_blocks([(4, 0), (1, 2)])
    torch.testing.assert_close(slots_to_blocks(rows.kv, B), blocks.kv, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny"])
def test_engine_greedy_output_equals_eager(make_checkpoint, preset):
    """Batching, chunked prefill, prefix hits and preemption, compiled and eager: the same tokens."""
    path = make_checkpoint(preset)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 300, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 300, (int(n),), generator=g).tolist() for n in torch.randint(1, 90, (20,))]
    settings = dict(num_kv_blocks=40, max_num_seqs=16, max_num_batched_tokens=64)
    compiled = LLM(path, attention_backend="compiled", **settings)
    assert compiled.scheduler.engine_config.attention_backend == "compiled"
    got = compiled.generate(prompts, GREEDY, use_tqdm=False)
    stats = compiled.stats()
    assert stats["num_preemptions"] > 0 and stats["recompute_cache_hit_tokens"] > 0
    want = LLM(path, attention_backend="eager", **settings).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_speculative_decoding_with_the_compiled_backend_equals_eager(tiny_checkpoint):
    """n-gram speculation's verification chunks read the block layout (chunk_context): the same greedy
    tokens as plain eager decoding, with proposals made and accepted."""
    g = torch.Generator().manual_seed(3)
    passages = [torch.randint(0, 400, (int(n),), generator=g).tolist() for n in (30, 55, 80)]
    prompts = [p + p[:10] for p in passages]  # a passage, then its first tokens again
    spec = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3, num_kv_blocks=64)
    compiled = LLM(tiny_checkpoint, attention_backend="compiled", **spec)
    got = compiled.generate(prompts, GREEDY, use_tqdm=False)
    assert compiled.stats()["spec_decode_num_accepted_tokens"] > 0
    want = LLM(tiny_checkpoint, attention_backend="eager", num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_no_recompile_after_warm_up(tiny_checkpoint, monkeypatch):
    """dynamic=True: batch sizes and context lengths, one and two sequences and blocks included, never
    recompile; nor does a new thread count (compile_for_cpu drops that guard).
    From a clean slate: kernels compiled by earlier tests must not cover for the warm-up."""
    torch._dynamo.reset()
    monkeypatch.setattr(compiled_module, "LONE_EAGER_MAX_CONTEXT", 0)  # lone sequences through the kernel on any CPU
    llm = LLM(tiny_checkpoint, attention_backend="compiled", num_kv_blocks=64, max_num_seqs=8)
    # config.patch, not monkeypatch: Dynamo's config module does not take a setattr undone, and later
    # compiles in the process fail.
    with torch._dynamo.config.patch(error_on_recompile=True):
        generate_varied_batches(llm)


def test_falls_back_to_eager_when_compiling_fails(tiny_checkpoint, monkeypatch, caplog):
    def broken(self, *shapes):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(CompiledBackend, "_check", broken)
    with caplog.at_level(logging.WARNING, logger="minfer"):
        llm = LLM(tiny_checkpoint, attention_backend="compiled", num_kv_blocks=32)
    assert llm.scheduler.engine_config.attention_backend == "eager"
    assert "compiled attention is off" in caplog.text and "no C++ compiler found" in caplog.text
    assert llm.generate(["hi"], GREEDY, use_tqdm=False)[0].token_ids


def test_falls_back_when_results_differ(monkeypatch, caplog):
    monkeypatch.setattr(CompiledBackend, "decode_attention", lambda self, q, *rest: q * 2)
    backend = CompiledBackend("cpu", torch.float32)
    assert "differ from the eager backend" in backend.warm_up(4, 4, 16)


def test_enforce_eager_and_the_eager_choice_never_compile(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(CompiledBackend, "warm_up", lambda *a: pytest.fail("compiled under enforce_eager"))
    assert LLM(tiny_checkpoint, enforce_eager=True, num_kv_blocks=32).scheduler.engine_config.attention_backend == "eager"
    llm = LLM(tiny_checkpoint, attention_backend="eager", num_kv_blocks=32)
    assert type(llm.scheduler.runner.attention) is CPUTiledBackend
    # $MINFER_ATTENTION_BACKEND only changes the default, which --enforce-eager overrides; given, it is refused
    monkeypatch.setenv("MINFER_ATTENTION_BACKEND", "compiled")
    assert LLM(tiny_checkpoint, enforce_eager=True, num_kv_blocks=32).scheduler.engine_config.attention_backend == "eager"


def test_prepare_model_keeps_eager_off_cpu_choices(monkeypatch):
    """auto: compiled for a 16-bit cache on a CPU; an fp32 cache compiled only where the CPU has AMX
    (elsewhere its eager read, with no upcast, was as fast)."""
    assert prepare.choose_attention_backend("cpu", torch.bfloat16, "auto").name == "compiled"
    assert prepare.choose_attention_backend("cpu", torch.float16, "auto").name == "compiled"
    monkeypatch.setattr(selector, "cpu_has_amx", lambda: False)
    assert prepare.choose_attention_backend("cpu", torch.float32, "auto").name == "cpu_tiled"
    monkeypatch.setattr(selector, "cpu_has_amx", lambda: True)
    assert prepare.choose_attention_backend("cpu", torch.float32, "auto", kv_width=768).name == "compiled"
    assert prepare.choose_attention_backend("cpu", torch.float64, "auto").name == "cpu_tiled"
    assert prepare.choose_attention_backend("cpu", torch.float32, "compiled").name == "compiled"
    assert prepare.choose_attention_backend("cpu", torch.float32, "eager").name == "cpu_tiled"
    # a narrow cache (minfer-tiny: 4 heads x 32) runs the plain backend: the compiled call's fixed cost
    # outweighs it, and the tiled read pays for its tiles only on wide contexts
    monkeypatch.setattr(selector, "MIN_CPU_KV_WIDTH", 512)
    assert prepare.choose_attention_backend("cpu", torch.float32, "auto", kv_width=128).name == "torch"
    assert prepare.choose_attention_backend("cpu", torch.bfloat16, "auto", kv_width=128).name == "torch"
    assert prepare.choose_attention_backend("cpu", torch.float32, "eager", kv_width=128).name == "torch"
    assert prepare.choose_attention_backend("cpu", torch.float32, "eager", kv_width=512).name == "cpu_tiled"
    assert prepare.choose_attention_backend("cpu", torch.bfloat16, "auto", kv_width=768).name == "compiled"
    assert prepare.choose_attention_backend("cpu", torch.bfloat16, "compiled", kv_width=128).name == "compiled"
    # off a CPU "compiled" is FlexAttention (flex.py), and the CPU's own backends are refused
    assert prepare.choose_attention_backend("meta", torch.float32, "compiled").name == "flex"
    with pytest.raises(ValueError, match="runs on cpu only"):
        prepare.choose_attention_backend("meta", torch.float32, "cpu_tiled")


def test_the_kv_cache_is_a_normal_tensor_whoever_builds_it(tiny_checkpoint):
    """Dynamo guards on inference vs normal tensors: warm_up's cache and the engine's must be alike."""
    config = load_model(tiny_checkpoint).config
    with torch.inference_mode():
        cache = KVCache(config, num_blocks=4, block_size=16, device="cpu", dtype=torch.float32)
    assert not cache.kv.is_inference()
