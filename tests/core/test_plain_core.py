"""The plain core, built without the assembly: OnlineScheduler on the plain attention backend, with no
feature attached. It serves what tutorials 01-13 teach exactly as the whole engine does, and refuses
what only a feature could do, naming the function that attaches it."""

import pytest
from engine_checks import random_prompts

from minfer import LLM, EngineConfig, OnlineScheduler, SamplingParams
from minfer.attention.backend import AttentionBackend
from minfer.attention.torch_sdpa import TorchBackend
from minfer.models.registry import load_model
from minfer.text.tokenizer import Tokenizer


@pytest.fixture
def plain(tiny_checkpoint):
    def make(**settings):
        model = load_model(tiny_checkpoint)
        return OnlineScheduler(model, Tokenizer.from_dir(tiny_checkpoint), EngineConfig(**settings))

    return make


def run(sched: OnlineScheduler, prompts, params):
    ids = [sched.add_request(prompt_token_ids=p, sampling_params=params) for p in prompts]
    for _ in sched.steps():
        sched.check_invariants()
    return [out for i in ids for out in sched.pop_responses(i)]


def test_the_plain_core_equals_the_whole_engine(plain, tiny_checkpoint):
    """Chunked prefill, preemption and prefix hits on the plain backend, eager, unpacked linears: the
    greedy tokens the assembled engine (the CPU's tiled backend, packed linears) gives."""
    prompts = random_prompts(24, 512, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0)
    sched = plain(num_kv_blocks=40, max_num_seqs=24, max_num_batched_tokens=64)
    assert type(sched.attention) is TorchBackend and not any(vars(sched.features).get(k) for k in
                                                             ("scoring", "forks", "speculation", "compiled", "threads"))
    outs = run(sched, prompts, params)
    assert sched.num_preemptions > 0 and sched.recompute_cache_hit_tokens > 0
    whole = LLM(tiny_checkpoint).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]
    assert sched.allocator.num_free_blocks == sched.allocator.num_blocks and not sched.requests


def test_n_choices_without_forks_are_n_sequences(plain, tiny_checkpoint):
    """n > 1 in the core: each choice a sequence of its own computing the prompt (as vLLM v1's child
    requests do). The draws are the forking engine's: choice i is seeded seed + i either way."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    prompt = random_prompts(1, 512, seed=4, min_len=40, max_len=40)[0]
    sched = plain(num_kv_blocks=64)
    outs = run(sched, [prompt], params)
    assert [o.index for o in outs] == [0, 1, 2]
    forked = LLM(tiny_checkpoint).generate([prompt], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in forked]


def test_what_only_a_feature_does_is_refused_naming_the_assembly(plain):
    for settings in (dict(speculative_method="ngram"), dict(compile_decode_step=True), dict(quantization="int8")):
        with pytest.raises(ValueError, match="minfer.assembly.build_engine"):
            plain(**settings)
    sched = plain(num_kv_blocks=16)
    for asks in (dict(logprobs=2), dict(prompt_logprobs=0)):
        with pytest.raises(ValueError, match="minfer.assembly.build_engine"):
            sched.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(**asks))
    assert not sched.requests


def test_a_backend_declares_every_capability_with_a_default():
    """The Protocol holds every capability a backend may have; the plain one keeps the defaults."""
    backend = TorchBackend("cpu", None)
    assert AttentionBackend in type(backend).__mro__
    assert not backend.captures_in_graphs and not backend.lone_decode_in_graph and backend.warm_up_seconds is None
    assert backend.warm_up(4, 4, 16, 16) is None
    with pytest.raises(NotImplementedError, match="CUDA graph"):
        backend.graph_metadata(None, None, None, 16, 0)
    with pytest.raises(NotImplementedError, match="lone decode"):
        backend.traced_lone_decode(None, None, None, None, None, 1.0)


