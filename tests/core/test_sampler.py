"""The sampler (engine/sampling.py, tutorial stage 04): greedy rows, seeds that make a request's draws
independent of its batch (in the engine too), top-k and top-p, draws that follow the softmax, mixed batches
and bf16 logits."""

import pytest
import torch
from engine_checks import random_prompts

from minfer import LLM

from minfer.engine import top_k_top_p
from minfer.engine.draw import draw_from, greedy_tokens
from minfer.engine.sampling import make_generator, sample
from minfer.engine.sampling_params import SamplingParams
from minfer.engine.top_k_top_p import apply_top_k_top_p

SP = SamplingParams


def _gens(params):
    return [make_generator(p.seed, "cpu") for p in params]


def _counts(tokens, V):
    return torch.bincount(tokens, minlength=V).double()


def _chi2(counts, probs):
    expected = probs.double() * counts.sum()
    keep = expected > 0
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()


# --- greedy -------------------------------------------------------------------


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SP(temperature=0)] * 5
    out = sample(logits, params, [None] * 5)
    assert out.dtype == torch.int64 and out.shape == (5,)
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_temperature_below_1e_5_is_greedy(temperature):
    """As vLLM: below 1e-5 only the top token has a chance. 1e-300 is 0 in fp32, and the logits divided by it
    were inf: the draw fell back to the last id (a 19-nats-unlikely EOS on minfer-tiny)."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = [SP(temperature=temperature, seed=i) for i in range(4)]
    assert all(p.is_greedy for p in params) and not SP(temperature=1e-5).is_greedy
    assert torch.equal(sample(logits, params, _gens(params)), logits.argmax(-1))


@pytest.mark.parametrize("controls", [{}, {"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.1}])
def test_a_row_with_no_finite_logit_draws_an_id_in_the_vocabulary(controls):
    """Nothing to draw from: an id in range, not one past the end (the next step would index with it),
    and its neighbours draw as ever."""
    logits = torch.full((2, 10), float("-inf"))
    logits[1, 3] = 0.0  # the second row has exactly one finite logit
    params = [SP(temperature=1.0, **controls)] * 2
    out = sample(logits, params, [None] * 2)
    assert 0 <= out[0] < 10 and out[1] == 3


@pytest.mark.parametrize("top_k", [51, 2**63, 10**30])
def test_a_top_k_past_the_vocabulary_is_top_k_of_all_of_it(top_k):
    """Draw for draw as top_k = V (every token kept). A k past int64 once failed the whole step, every request in it."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    params, whole = [SP(top_k=top_k, seed=i) for i in range(3)], [SP(top_k=50, seed=i) for i in range(3)]
    assert all(p.top_k == top_k for p in params)  # kept as asked
    assert torch.equal(sample(logits, params, _gens(params)), sample(logits, whole, _gens(whole)))


def test_top_k_1_equals_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [SP(temperature=1.0, top_k=1, seed=i) for i in range(4)]
    assert all(p.is_greedy for p in params)
    for _ in range(5):
        assert torch.equal(sample(logits, params, _gens(params)), logits.argmax(-1))


def test_sample_does_not_sync(monkeypatch):
    # Rows narrower than CPU_HEAD take the whole-row path, the one a GPU always takes: it never
    # reads a tensor on the host. (A CPU's head path checks one flag per batch, which is free there.)
    def boom(*a, **k):
        raise AssertionError("sample() must not sync with the host")

    for method in ("item", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, method, boom)
    params = [SP(temperature=0), SP(top_k=3, seed=1), SP(top_p=0.5), SP(temperature=0.7)]
    sample(torch.randn(4, 30), params, _gens(params))


# --- seeds --------------------------------------------------------------------


def test_same_seed_same_tokens_whatever_the_batch():
    V, steps = 200, 6
    g = torch.Generator().manual_seed(42)
    target_logits = [torch.randn(V, generator=g) * 0.5 for _ in range(steps)]  # flat-ish
    target = SP(temperature=0.9, top_p=0.95, seed=123)

    def stream(neighbours, position):
        gens = [make_generator(p.seed, "cpu") for p in neighbours]
        target_gen = make_generator(target.seed, "cpu")
        tokens = []
        for t in range(steps):
            rows = [torch.randn(V) for _ in neighbours]
            rows.insert(position, target_logits[t])
            params = list(neighbours)
            params.insert(position, target)
            row_gens = list(gens)
            row_gens.insert(position, target_gen)
            tokens.append(int(sample(torch.stack(rows), params, row_gens)[position]))
        return tokens

    alone = stream([], 0)
    torch.manual_seed(7)  # neighbours without a seed use the global RNG
    crowded = stream([SP(temperature=0), SP(top_k=5), SP(temperature=2.0, seed=9)], 2)
    other = stream([SP(top_p=0.3, seed=5)], 0)
    first_of_many = stream([SP()] * 7, 0)
    assert alone == crowded == other == first_of_many
    assert len(set(alone)) > 1  # really sampling, not stuck on one token


def test_different_seeds_give_different_streams():
    V, steps = 1000, 8
    logits = torch.zeros(1, V)  # uniform
    streams = set()
    for seed in range(5):
        g = make_generator(seed, "cpu")
        streams.add(tuple(int(sample(logits, [SP(seed=seed)], [g])) for _ in range(steps)))
    assert len(streams) == 5


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(3, "cpu"), make_generator(3, "cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    make_generator(-1, "cpu")  # any int is accepted
    make_generator(2**70, "cpu")


def test_seeded_sampling_ignores_batch_neighbours(tiny_checkpoint):
    # float64: in fp32 another batch's rounding moves about one draw in 6,000 (docs/sampling.md)
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, dtype="float64")
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42)
    prompt = [5, 6, 7, 8]
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].token_ids
    others = random_prompts(7, 512, seed=3, max_len=40)
    params = [SamplingParams(max_tokens=20, temperature=1.0)] * 7
    batch = llm.generate(others[:3] + [prompt] + others[3:], params[:3] + [seeded] + params[3:], use_tqdm=False)
    assert batch[3].token_ids == alone
    assert llm.generate([prompt], SamplingParams(max_tokens=20, seed=43), use_tqdm=False)[0].token_ids != alone


# --- top-p / top-k --------------------------------------------------------------

# Tokens are shuffled so the test also checks the mask is mapped back to vocab order.
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.5, {1}),
        (0.51, {1, 3}),
        (0.6, {1, 3}),
        (0.8, {1, 3}),
        (0.81, {1, 3, 0}),
        (0.95, {1, 3, 0}),
        (0.96, {1, 3, 0, 2}),
        (1.0, {1, 3, 0, 2}),
        (0.01, {1}),  # the top token always survives
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    logits = PROBS.log()[None]  # (1, 4)
    filtered = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([top_p]))
    assert set(torch.isfinite(filtered[0]).nonzero().flatten().tolist()) == kept
    assert torch.equal(filtered[0][list(kept)], logits[0][list(kept)])  # kept logits untouched

    n = 400
    g = make_generator(0, "cpu")
    tokens = sample(logits.expand(n, 4), [SP(top_p=top_p, seed=0)] * n, [g] * n)
    assert set(tokens.tolist()) == kept  # never a filtered token, every kept one shows up


def test_top_p_boundary_survives_float_rounding():
    # Ten tokens of 0.1: six reach p=0.6 exactly, although float32 sums them to 0.59999996.
    logits = torch.full((1, 10), 0.1).log()
    filtered = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.6]))
    assert torch.isfinite(filtered).sum() == 6


def test_top_k_keeps_k_tokens():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    filtered = apply_top_k_top_p(logits, torch.tensor([1, 5, 0]), torch.ones(3))
    for row, k in zip(range(3), [1, 5, 20]):
        kept = torch.isfinite(filtered[row]).nonzero().flatten()
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())

    n = 300
    params = [SP(top_k=3)] * n
    tokens = sample(logits[:1].expand(n, 20), params, [None] * n)
    assert set(tokens.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_top_k_then_top_p_renormalises():
    # top_k=3 leaves [0.5, 0.3, 0.15] / 0.95; top_p=0.8 then needs 0.5/0.95 + 0.3/0.95 = 0.84.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    filtered = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.8]))
    assert torch.isfinite(filtered[0]).tolist() == [True, True, False, False]


def test_head_path_draws_what_sorting_whole_rows_draws(monkeypatch):
    # On a CPU top-k/top-p sort only each row's likeliest tokens, growing the head 16x while a row's
    # nucleus reaches past it. Same seeds must give the same tokens as sorting whole rows.
    V = 3000
    g = torch.Generator().manual_seed(5)
    rows = torch.stack([torch.randn(V, generator=g) * s for s in (12.0, 3.0, 4.0, 0.2)])  # peaked .. flat
    params = [SP(top_p=0.9, seed=1), SP(top_p=0.95, seed=2), SP(top_k=100, top_p=0.8, seed=3), SP(top_p=0.7, seed=4)]
    heads = []
    real_kept_head = top_k_top_p.kept_head
    monkeypatch.setattr(top_k_top_p, "kept_head", lambda *a: heads.append(a[3]) or real_kept_head(*a))  # a[3]: K

    def draws(head_size):
        monkeypatch.setattr(top_k_top_p, "CPU_HEAD", head_size)
        gens = _gens(params)
        return [sample(rows, params, gens).tolist() for _ in range(30)]

    whole = draws(10**9)
    assert set(heads) == {V}
    heads.clear()
    assert draws(8) == whole
    assert set(heads) == {100, 1600, V}  # top_k=100 widens the first head; the flat rows need all of V
    nucleus = [
        int(torch.isfinite(apply_top_k_top_p(r[None], torch.tensor([p.top_k]), torch.tensor([p.top_p]))).sum())
        for r, p in zip(rows, params)
    ]
    assert nucleus[0] <= 100 < nucleus[1] <= 1600 < nucleus[3]  # each head size was really needed


def test_inverse_cdf_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.2, 0.8, 0.0, 0.0]] * 3)
    u = torch.tensor([0.0, 0.5, 1.0])  # rand draws from [0, 1); the guard holds even at 1, whatever the rounding
    assert draw_from(probs.clone(), u).tolist() == [1, 2, 2]


# --- distributions --------------------------------------------------------------


def test_samples_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = logits.softmax(-1)
    n = 20000
    torch.manual_seed(0)
    unseeded = sample(logits.expand(n, 6), [SP()] * n, [None] * n)
    # df = 5: chi2 > 25 has p < 1.4e-4, so a correct sampler fails only by bad luck.
    assert _chi2(_counts(unseeded, 6), probs) < 25

    n = 4000
    g = make_generator(0, "cpu")
    seeded = sample(logits.expand(n, 6), [SP(seed=0)] * n, [g] * n)
    assert _chi2(_counts(seeded, 6), probs) < 25


def test_filtered_samples_match_renormalised_probs():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    n = 10000
    torch.manual_seed(1)
    tokens = sample(logits.expand(n, 4), [SP(top_p=0.9)] * n, [None] * n)
    assert _chi2(_counts(tokens, 4), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95) < 20


def test_lower_temperature_concentrates_mass():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    n = 5000
    torch.manual_seed(2)
    top_share = []
    for temp in [3.0, 1.0, 0.3]:
        tokens = sample(logits.expand(n, 4), [SP(temperature=temp)] * n, [None] * n)
        counts = _counts(tokens, 4)
        assert _chi2(counts, (logits / temp).softmax(-1)) < 25
        top_share.append(counts[0].item() / n)
    assert top_share[0] < top_share[1] < top_share[2]
    assert top_share[2] > 0.75  # softmax(logits / 0.3)[0] ~= 0.8


# --- mixed batch / dtypes ----------------------------------------------------------


def test_mixed_batch_each_row_keeps_its_behaviour():
    V = 50
    g = torch.Generator().manual_seed(3)
    base = torch.randn(V, generator=g)
    peaked = torch.full((V,), -10.0)
    peaked[7], peaked[8] = 1.0, 0.9  # top_p=0.5 keeps only token 7
    rows = [base, base, base, base, peaked, base]
    params = [
        SP(temperature=0),
        SP(top_k=1, temperature=1.5),
        SP(temperature=1.0),
        SP(top_k=2, seed=11),
        SP(top_p=0.5),
        SP(temperature=0.8, seed=5),
    ]
    logits = torch.stack(rows)
    gens = _gens(params)
    alone_gen = make_generator(5, "cpu")
    top2 = set(base.topk(2).indices.tolist())
    seen_free, seen_top2 = set(), set()
    for _ in range(100):
        out = sample(logits, params, gens).tolist()
        alone = int(sample(base[None], [params[5]], [alone_gen])[0])
        assert out[0] == out[1] == int(base.argmax())
        seen_free.add(out[2])
        seen_top2.add(out[3])
        assert out[4] == 7
        assert out[5] == alone
    assert seen_top2 == top2
    assert len(seen_free) > 5


def test_bf16_logits():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    params = [SP(temperature=0), SP(top_k=10, top_p=0.9, seed=1), SP(temperature=0.7, seed=2)]
    out = sample(logits, params, _gens(params))
    assert out.dtype == torch.int64 and out.shape == (3,)
    assert int(out[0]) == int(logits[0].float().argmax())
    # Same draws as the float32 copy: the sampler works in float32 either way.
    assert torch.equal(out, sample(logits.float(), params, _gens(params)))


def test_empty_filter_free_batch_of_one():
    out = sample(torch.randn(1, 10), [SP(temperature=0.5)], [None])
    assert out.shape == (1,) and 0 <= int(out[0]) < 10


def test_greedy_tokens_are_argmax_on_ties_nan_and_bf16():
    """greedy_tokens (max(dim).indices, the faster op) picks what argmax picks: the first of tied maxima,
    a NaN's index; and on bf16 logits, which greedy rows no longer widen to fp32, the fp32 argmax."""
    ties = torch.tensor([[0.0, 1.0, 0.0, 1.0], [5.0, 5.0, 5.0, 5.0], [0.0, 2.0, float("nan"), float("nan")]])
    assert greedy_tokens(ties).tolist() == ties.argmax(dim=-1).tolist() == [1, 0, 2]
    logits = torch.randn(16, 1003, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits[3, 7] = logits[3, 900] = 50.0  # a tie in bf16
    assert torch.equal(greedy_tokens(logits), logits.float().argmax(dim=-1))
    params = [SamplingParams(temperature=0)] * 16
    assert torch.equal(sample(logits, params, [None] * 16), logits.float().argmax(dim=-1))
