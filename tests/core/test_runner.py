"""The runner (engine/model_runner.py): one flat forward per step over every scheduled token, the LM head only
on the rows that sample; the engine in half precision, and in bf16 within twice transformers' own bf16 error."""

import pytest
import torch
from conftest import only_on_cpu
from engine_checks import GREEDY, assert_all_free, random_prompts

from minfer import LLM, SamplingParams
from minfer.cpu import linears as cpu_linears
from minfer.cpu.linears import Bf16StorageLinear

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return transformers.GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32).eval()


def test_one_flat_forward_per_step_and_lm_head_only_where_sampling(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, max_num_batched_tokens=40)
    sched, model = llm.scheduler, llm.model
    short = [sched.add_request(prompt_token_ids=[1, 2, 3], sampling_params=GREEDY) for _ in range(3)]
    sched.step()  # the three short prompts prefill and sample together
    long_id = sched.add_request(prompt_token_ids=list(range(100)), sampling_params=GREEDY)
    calls = []
    model.forward = lambda ids, paged: calls.append(("forward", ids.shape)) or type(model).forward(model, ids, paged)
    hook = model.lm_head.register_forward_hook(lambda module, args, out: calls.append(("lm_head", args[0].shape)))
    try:
        sched.step()  # 3 decodes + a 37-token chunk of the long prompt, which does not sample yet
    finally:
        del model.forward
        hook.remove()
    assert calls == [("forward", (40,)), ("lm_head", (3, model.config.n_embd))]
    assert sched.last_step.num_decode_tokens == 3 and sched.last_step.num_prefill_tokens == 37
    for i in short + [long_id]:
        sched.discard_request(i)
    assert_all_free(llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engine(tiny_checkpoint, dtype):
    llm = LLM(tiny_checkpoint, dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=64)
    assert llm.scheduler.kv_cache.k.dtype == getattr(torch, dtype)
    prompts = random_prompts(6, 512, seed=4, max_len=100)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert_all_free(llm)


def engine_logits(llm: LLM, prompt: list[int], prefill: int) -> torch.Tensor:
    """The engine's next-token logits at positions prefill-1 .. len(prompt)-1: a chunked prefill of
    `prefill` tokens, then the rest teacher-forced through decode steps. Returns (T, V) in fp32."""
    model, sched = llm.model, llm.scheduler
    rid = sched.add_request(prompt_token_ids=prompt[:prefill], sampling_params=SamplingParams(max_tokens=20))
    seq = sched.requests[rid].seq
    logits = []
    model.forward = lambda *args: logits.append(type(model).forward(model, *args)) or logits[-1]
    try:
        while seq.num_computed_tokens < prefill:
            sched.step()
        for t in prompt[prefill:]:
            seq.token_ids[-1] = t
            sched.step()
    finally:
        del model.forward
        sched.discard_request(rid)
    return torch.cat(logits).float().cpu()


@only_on_cpu("bf16 linears, prepacked or not")
@torch.inference_mode()
@pytest.mark.parametrize("path", ["this CPU's", "bf16 storage, fp32 matmuls"])
def test_bf16_engine_matches_a_bf16_reference(tiny_checkpoint, hf_model, monkeypatch, path):
    """The engine in bf16 (on CPU: prepacked bf16 linears where the CPU has native bf16, context tiles
    upcast to fp32) against transformers in bf16 on the same checkpoint. Both round differently, so the
    tolerance is stated against the fp32 reference: the engine's bf16 error may be at most twice
    transformers' own bf16 error (measured here: 0.0094 vs 0.0085 on a Zen 4 CPU)."""
    prompt = torch.randint(0, 511, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    exact = hf_model(torch.tensor([prompt])).logits[0, 89:]  # (11, V) fp32 reference
    hf_bf16 = transformers.GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.bfloat16).eval()
    reference_error = (hf_bf16(torch.tensor([prompt])).logits[0, 89:].float() - exact).abs().max().item()
    if path != "this CPU's":  # what a CPU without native bf16 runs (e.g. AVX2-only)
        monkeypatch.setattr(cpu_linears, "packing_available", lambda dtype: False)
    llm = LLM(tiny_checkpoint, dtype="bfloat16", num_kv_blocks=32, max_num_batched_tokens=37)
    expected = cpu_linears.PackedLinear if cpu_linears.packing_available(torch.bfloat16) else Bf16StorageLinear
    assert type(llm.model.h[0].mlp.c_fc) is expected
    ours = engine_logits(llm, prompt, 90)
    assert llm.scheduler.kv_cache.k.dtype == torch.bfloat16
    our_error = (ours - exact).abs().max().item()
    assert 0 < our_error <= 2 * reference_error, (our_error, reference_error)
    assert_all_free(llm)
