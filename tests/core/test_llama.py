"""Qwen3 and Llama: minfer's Llama module against transformers on random checkpoints the tests write,
through the plain forward and through the engine (batching, chunked prefill, preemption, prefix hits)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from engine_checks import assert_all_free, greedy_without_cache, random_prompts

from minfer import LLM, SamplingParams
from minfer.attention.kv_cache import KVCache
from minfer.cpu.linears import packing_available
from minfer.cpu.packing import LMHead
from minfer.models.llama import Llama
from minfer.models.registry import load_model, read_config

transformers = pytest.importorskip("transformers")

FAMILIES = ["qwen3-tiny", "llama-tiny", "llama2-tiny"]  # llama2-tiny: a SentencePiece-style tokenizer
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("preset", FAMILIES + ["llama3-rope"])
@torch.inference_mode()
def test_logits_and_greedy_match_transformers(make_checkpoint, preset, device):
    if preset == "llama3-rope":  # Llama 3's rescaled rotary frequencies, on a context longer than 64
        path = make_checkpoint("llama-tiny", seed=1, rope_scaling=LLAMA3_ROPE)
    else:
        path = make_checkpoint(preset, seed=1)
    ours, ref = load_model(path, device), hf_model(path)
    assert isinstance(ours, Llama) and type(ref).__name__ == ours.config.architecture
    ids = torch.randint(0, 500, (2, 80), generator=torch.Generator().manual_seed(0))
    logits = ours(ids.to(device)).cpu()
    assert logits.shape == (2, 80, 512) and logits.std() > 0.5
    torch.testing.assert_close(logits, ref(ids).logits, atol=1e-4, rtol=0)
    prompt = ids[:2, :7]
    expected = ref.generate(  # eos_token_id=None: run all 24 tokens, neither stopping at EOS nor suppressing it
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False, eos_token_id=None
    )
    got = greedy_without_cache(ours, prompt, 24)
    assert torch.equal(got, expected) and len(set(got[0, 7:].tolist())) > 1


def test_config_facts_the_engine_reads(make_checkpoint):
    qwen, llama = read_config(make_checkpoint("qwen3-tiny")), read_config(make_checkpoint("llama-tiny"))
    # Qwen3 sets head_dim apart from hidden / heads; Llama derives it.
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim, qwen.max_positions) == (2, 2, 32, 512)
    assert (llama.num_kv_heads, llama.head_dim, llama.vocab_size) == (2, 16, 512)
    assert qwen.qk_norm and qwen.tie_word_embeddings and not llama.qk_norm and not llama.tie_word_embeddings
    # GQA: the cache holds 2 key/value heads, not 4 query heads: half the bytes of full attention.
    assert KVCache.bytes_per_block(llama, 16, torch.float32) == 2 * 16 * 2 * 2 * 16 * 4


@pytest.mark.parametrize("preset", FAMILIES)
def test_engine_batched_equals_alone_and_transformers(make_checkpoint, preset):
    path = make_checkpoint(preset)
    ref = hf_model(path)
    prompts = random_prompts(10, 500, max_len=120)
    greedy = SamplingParams(max_tokens=20, temperature=0)
    busy = LLM(path, num_kv_blocks=22, max_num_seqs=10, max_num_batched_tokens=64)
    assert busy.scheduler.kv_cache.k.shape[2] == 2  # num_key_value_heads, not the 4 query heads
    if busy.model.device.type == "cpu" and packing_available(torch.float32):  # the CPU swapped the LM head
        assert isinstance(busy.model.lm_head, LMHead)
    together = busy.generate(prompts, greedy, use_tqdm=False)
    stats = busy.stats()
    assert stats["num_preemptions"] > 0 and stats["recompute_cache_hit_tokens"] > 0
    assert_all_free(busy)
    alone_llm = LLM(path, num_kv_blocks=40, enable_prefix_caching=False)
    eos = busy.tokenizer.eos_token_ids
    for prompt, out in zip(prompts, together):
        ids = torch.tensor([prompt])
        expected = ref.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, eos_token_id=eos
        )[0, len(prompt) :].tolist()
        assert out.token_ids == alone_llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids == expected
    assert sum(len(set(o.token_ids)) > 4 for o in together) > 5


def test_bf16_engine_runs(make_checkpoint):
    llm = LLM(make_checkpoint("qwen3-tiny"), dtype="bfloat16", num_kv_blocks=16)
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 8 and llm.scheduler.kv_cache.k.dtype == torch.bfloat16


def test_sharded_checkpoint_loads_the_same(make_checkpoint, tmp_path, device):
    path = make_checkpoint("llama-tiny")
    d = tmp_path / "sharded"
    shutil.copytree(path, d)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / file))
        weight_map |= dict.fromkeys(part, file)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = torch.tensor([[5, 6, 7]], device=device)
    with torch.inference_mode():
        torch.testing.assert_close(load_model(d, device)(ids), load_model(path, device)(ids), atol=0, rtol=0)


def _edited(path, tmp_path, config=None, tensors=None):
    d = tmp_path / "edited"
    shutil.copytree(path, d)
    if config is not None:
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config(raw) or raw))
    if tensors is not None:
        state = load_file(str(d / "model.safetensors"))
        tensors(state)
        save_file(state, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        (lambda c: c.update(architectures=["MistralForCausalLM"]), None, "runs these architectures: GPT2LMHeadModel"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), None, "rope_scaling 'yarn'"),
        (lambda c: c.update(num_key_value_heads=3), None, "multiple of num_key_value_heads"),
        (lambda c: c.update(hidden_act="gelu"), None, "hidden_act 'gelu'"),
        (lambda c: c.update(use_sliding_window=True), None, "sliding-window attention"),
        (lambda c: c.update(rms_norm_eps=None), None, "rms_norm_eps must be a positive number, got None"),
        (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), None,
         "rope_scaling 'llama3' needs low_freq_factor, high_freq_factor, original_max_position_embeddings"),
        (lambda c: c.update(rope_parameters=5), None, "rope_parameters must be an object, got 5"),
        (lambda c: c.update(num_key_value_heads=0), None, "num_key_value_heads must be a positive integer, got 0"),
        (lambda c: c.update(head_dim=0), None, "head_dim must be a positive integer, got 0"),
        (lambda c: c.update(tie_word_embeddings="false"), None, "tie_word_embeddings must be true or false"),
        (lambda c: c.update(architectures="Qwen3ForCausalLM"), None, "architectures must be a list of class names"),
        (None, lambda s: s.pop("model.layers.1.self_attn.k_norm.weight"), "lacks tensor 'layers.1.self_attn.k_norm"),
        (None, lambda s: s.update({"model.extra.weight": torch.zeros(2)}), "unexpected tensor 'model.extra.weight'"),
        (None, lambda s: s.update({"model.norm.weight": torch.zeros(3)}), "has shape [3], but config.json implies"),
    ],
)
def test_bad_checkpoints_get_one_clear_error(make_checkpoint, tmp_path, config, tensors, message):
    d = _edited(make_checkpoint("qwen3-tiny"), tmp_path, config, tensors)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        load_model(d)


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 16)])
def test_rms_norm_is_transformers_bit_for_bit(shape):
    """fp32 applies the weight inside F.rms_norm; bf16 rounds the normed value before the weight multiplies it.
    Both are transformers' Qwen3RMSNorm / LlamaRMSNorm to the bit."""
    from minfer.models.llama import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6)
    torch.nn.init.normal_(norm.weight)
    for dtype in (torch.float32, torch.bfloat16):
        x, weight = torch.randn(shape, dtype=dtype) * 3, norm.weight.detach().to(dtype)
        wide = x.float()
        reference = weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        assert torch.equal(norm.to(dtype)(x), reference), dtype


@pytest.mark.parametrize("same", [True, False])
@torch.inference_mode()
def test_a_tied_checkpoint_that_stores_its_lm_head_loads_as_transformers_loads_it(make_checkpoint, tmp_path, caplog,
                                                                                   same):
    """config.json ties the LM head to the embedding, yet the checkpoint stores lm_head.weight too. The same
    values: tied, as config.json says. Different ones: transformers keeps the two apart (with a warning), and
    so its logits are the stored head's; minfer's must be too, and it must say why."""
    def store_head(state):
        embedding = state["model.embed_tokens.weight"]
        state["lm_head.weight"] = embedding.clone() if same else torch.randn_like(embedding)

    d = _edited(make_checkpoint("llama-tiny", seed=2, tie_word_embeddings=True), tmp_path, tensors=store_head)
    with caplog.at_level("WARNING", logger="minfer"):
        ours = load_model(d)
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids), hf_model(d)(ids).logits, atol=1e-4, rtol=0)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == same == ours.config.tie_word_embeddings
    warned = [r.getMessage() for r in caplog.records if r.name == "minfer" and "lm_head.weight" in r.getMessage()]
    assert len(warned) == (0 if same else 1), caplog.text
    assert same or "differs from" in warned[0] and "tie_word_embeddings" in warned[0]
