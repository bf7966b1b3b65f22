"""Paged attention (tutorial stage 08): chunked paged prefill and decode give the dense forward's logits at every
position, decode groups bound their padding, and garbage in unwritten cache slots never reaches a result."""

import pytest
import torch
from conftest import only_on_cpu
from engine_checks import GREEDY, assert_all_free

from minfer import LLM, SamplingParams
from minfer.models.gpt2 import GPT2


@torch.inference_mode()
def test_paged_forward_equals_dense_forward(tiny_checkpoint):
    """Chunked paged prefill + decode reproduce the plain forward's logits at every position. Eager: a CUDA
    graph's replay (the GPU's default) would run the decode steps past the model.forward watched here."""
    llm = LLM(tiny_checkpoint, num_kv_blocks=32, max_num_batched_tokens=37, enforce_eager=True)
    model: GPT2 = llm.model
    prompt = torch.randint(0, 511, (100,), generator=torch.Generator().manual_seed(9)).tolist()
    dense = model(torch.tensor([prompt], device=model.device))[0]  # (T, V)
    sched = llm.scheduler
    rid = sched.add_request(prompt_token_ids=prompt[:90], sampling_params=SamplingParams(max_tokens=20))
    seq = sched.requests[rid].seq
    logits = []

    def capture(input_ids, paged):
        out = type(model).forward(model, input_ids, paged)  # (S, V): the sampling rows only
        logits.append(out)
        return out

    model.forward = capture
    try:
        while seq.num_computed_tokens < 90:
            sched.step()  # 37 + 37 + 16 tokens: the last chunk samples position 89
        for t in prompt[90:]:  # teacher-force the rest through decode steps
            seq.token_ids[-1] = t
            sched.step()
    finally:
        del model.forward
    paged = torch.cat(logits)  # rows for positions 89, 90, ..., 99
    torch.testing.assert_close(paged, dense[89:], atol=1e-4, rtol=0)
    sched.discard_request(rid)
    assert_all_free(llm)


def test_decode_groups_bound_padding():
    from minfer.attention.torch_sdpa import group_by_length

    lens = [300, 20, 290, 25, 150, 18, 160]
    groups = group_by_length(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert g == sorted(g)  # batch order inside a group
        padded, real = max(lens[i] for i in g) * len(g), sum(lens[i] for i in g)
        assert padded <= 1.25 * real
    assert len(groups) == 3  # ~300, ~155, ~20
    assert group_by_length([7] * 10) == [list(range(10))]  # equal lengths: one group, no padding


# a cache in rows of slots, or in blocks (the compiled backend is the CPU's)
@pytest.mark.parametrize("backend", ["eager", pytest.param("compiled", marks=only_on_cpu("the compiled backend"))])
def test_garbage_in_unwritten_cache_slots_never_leaks(tiny_checkpoint, backend):
    """The cache starts uninitialised: padded attention positions, and the unwritten tail of a
    sequence's last block, must never reach the result."""
    prompts = [list(range(1, 41)), list(range(5, 69)), [7] * 3]  # decode groups with padding
    alone = LLM(tiny_checkpoint, num_kv_blocks=64, attention_backend=backend)
    expected = [alone.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, attention_backend=backend)
    cache = llm.scheduler.kv_cache
    assert (type(cache).__name__ == "BlockedKVCache") == (backend == "compiled")  # a block a row, or a slot a row
    end = cache.block_rows([cache.null_block])[0]  # where the null block starts along kv's second axis
    cache.kv[:, :end].fill_(float("nan"))  # every block but the null block: keys and values
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
