"""What many test files check an engine with: prompts that exercise the prefix cache, the check that every
KV block came back, two references (the plainest greedy loop, transformers' generate), and a run of steps of
every shape."""

import torch

from minfer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0)  # what most engine tests ask for


def random_prompts(n, vocab, seed=0, min_len=1, max_len=200, shared_prefix=48):
    """Mixed lengths; a third share a common prefix so the prefix cache has something to find."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab - 1, (shared_prefix,), generator=g).tolist()
    prompts = []
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab - 1, (length,), generator=g).tolist()
        prompts.append(prefix + ids[: max(1, length - shared_prefix)] if i % 3 == 0 else ids)
    return prompts


def assert_all_free(llm):
    stats = llm.stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert all(b.ref_count == 0 for b in llm.scheduler.allocator.blocks)
    assert not llm.scheduler.requests
    llm.scheduler.check_invariants()


def greedy_without_cache(model, ids, n):
    """The simplest generation loop: rerun the whole sequence, take the argmax of the last position.
    On the model's device; ids (B, T) come back on the CPU."""
    ids = ids.to(model.device)
    for _ in range(n):
        next_id = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids.cpu()


def hf_greedy(hf_model, prompt, max_new_tokens=32):
    """transformers' greedy continuation of one prompt (token ids), the reference for the engine's."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=hf_model.config.eos_token_id,
    )
    return out[0, len(prompt) :].tolist()


def generate_varied_batches(llm: LLM) -> None:
    """Steps where every row decodes (q a strided view) and mixed ones (q a copy); 2 sequences (the
    cache's K/V axis is 2 too); contexts of 1 token and several blocks; one thread and two, as
    CpuShare switches between them beside a busy process."""
    threads = torch.get_num_threads()
    try:
        for turn, (n, length) in enumerate([(1, 1), (2, 3), (5, 40), (1, 100), (8, 7), (3, 150), (2, 2)]):
            torch.set_num_threads(1 + turn % 2)
            prompts = [[(7 * i + j) % 500 for j in range(length + i)] for i in range(n)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
