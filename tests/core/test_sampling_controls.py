"""The sampling controls (penalties, min_p, logit_bias, min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens) against references: vLLM's formulas written out literally below, transformers' own
logits processors where it has the same control, and a transformers greedy loop for whole generations."""

from dataclasses import dataclass

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.engine.logits_processors import apply_logits_controls, apply_min_p
from minfer.engine.sampling import make_generator, sample
from minfer.errors import InvalidParameter
from minfer.text.text_stream import TextStream
from minfer.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

V = 512


@dataclass
class History:
    token_ids: list[int]
    num_prompt_tokens: int
    min_tokens_stop_ids: list[int]


# ---- references: vLLM's formulas, as vLLM writes them ---------------------------------


def vllm_apply_penalties(logits, prompt_tokens, output_tokens, presence, frequency, repetition):
    """vllm/model_executor/layers/utils.py apply_penalties, on padded (R, L) token tensors (pad = V)."""
    num_seqs, vocab_size = logits.shape

    def bin_counts_and_mask(tokens):
        counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.long)
        counts.scatter_add_(1, tokens, torch.ones_like(tokens))
        counts = counts[:, :vocab_size]
        return counts, counts > 0

    _, prompt_mask = bin_counts_and_mask(prompt_tokens)
    output_bin_counts, output_mask = bin_counts_and_mask(output_tokens)
    repetition = repetition.unsqueeze(dim=1).repeat(1, vocab_size)
    logits[logits > 0] /= torch.where(prompt_mask | output_mask, repetition, 1.0)[logits > 0]
    logits[logits <= 0] *= torch.where(prompt_mask | output_mask, repetition, 1.0)[logits <= 0]
    logits -= frequency.unsqueeze(dim=1) * output_bin_counts
    logits -= presence.unsqueeze(dim=1) * output_mask
    return logits


def vllm_min_p(logits, min_p):
    """vLLM v1's MinPLogitsProcessor.apply."""
    probability_values = torch.nn.functional.softmax(logits, dim=-1)
    max_probabilities = torch.amax(probability_values, dim=-1, keepdim=True)
    adjusted_min_p = max_probabilities.mul_(min_p.unsqueeze(1))
    logits = logits.clone()
    logits[probability_values < adjusted_min_p] = -float("inf")
    return logits


def padded(rows):
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [V] * (width - len(r)) for r in rows])


def random_case(seed, R=6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g) * 3
    params, histories = [], []
    for r in range(R):
        prompt = torch.randint(0, V, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, 60, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
        u = torch.rand(3, generator=g).tolist()
        params.append(
            SamplingParams(
                max_tokens=64,
                presence_penalty=round(4 * u[0] - 2, 3) if r % 3 else 0.0,
                frequency_penalty=round(4 * u[1] - 2, 3) if r % 2 else 0.0,
                repetition_penalty=1.0 if r == 2 else round(0.2 + 1.8 * u[2], 3),
            )
        )
        histories.append(History(prompt + output, len(prompt), []))
    return logits, params, histories


@pytest.mark.parametrize("seed", range(5))
def test_penalties_match_vllm_formula(seed):
    logits, params, histories = random_case(seed)
    ours = apply_logits_controls(logits.clone(), params, histories)
    reference = vllm_apply_penalties(
        logits.clone(),
        padded([h.token_ids[: h.num_prompt_tokens] for h in histories]),
        padded([h.token_ids[h.num_prompt_tokens :] for h in histories]),
        torch.tensor([p.presence_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
        torch.tensor([p.repetition_penalty for p in params]),
    )
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_repetition_penalty_and_min_p_match_transformers_processors():
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, V, generator=g) * 4
    ids = torch.randint(0, V, (1, 50), generator=g)
    history = History(ids[0].tolist(), 20, [])  # HF counts every token of input_ids: prompt + output
    ours = apply_logits_controls(logits.clone(), [SamplingParams(repetition_penalty=1.7)], [history])
    torch.testing.assert_close(ours, RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone()))
    for min_p in (0.05, 0.3, 0.9):
        hf = MinPLogitsWarper(min_p)(ids, logits.clone())
        mine = apply_min_p(logits.clone(), torch.tensor([min_p]))
        assert torch.equal(mine.isinf(), hf.isinf()), min_p
        assert torch.equal(mine, vllm_min_p(logits, torch.tensor([min_p])))


@pytest.mark.parametrize("repetition", [5e-324, 1e-40, 1e300])
def test_an_extreme_repetition_penalty_draws_no_nan(repetition):
    """Any penalty > 0 is allowed (vLLM's rule), but 5e-324 and 1e-40 are 0 in fp32 and 1e300 is inf: a seen
    logit then became inf (drawn as the fallback, the last id) or 0 * inf = NaN. Near 0 the seen tokens with
    positive logits take every draw; near inf a seen negative one never comes up."""
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0, 3.0, 0.5]])  # token 4 unseen and likeliest
    history = History([0, 1, 2, 3], 4, [])  # tokens 0-3 seen in the prompt
    params = [SamplingParams(repetition_penalty=repetition, seed=i) for i in range(40)]
    controlled = apply_logits_controls(logits.expand(40, -1).clone(), params, [history] * 40)
    assert not controlled.isnan().any() and not controlled.isposinf().any()
    drawn = set(sample(logits.expand(40, -1).clone(), params, [make_generator(p.seed, "cpu") for p in params],
                       [history] * 40).tolist())
    if repetition < 1:  # the seen positive logits, 2.0 and 1.0, both at the ceiling: a tie
        assert drawn == {0, 3}, drawn
    else:  # the seen -1.0 at -inf (or near it); the others about as if their logits were 0
        assert 4 in drawn and 2 not in drawn and drawn <= {0, 1, 3, 4, 5}, drawn


def test_logit_bias_and_min_tokens():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=g)
    params = [
        SamplingParams(logit_bias={5: 100, 7: -100, 9: 0.5}),
        SamplingParams(max_tokens=10, min_tokens=3, logit_bias={5: 1.0}),
        SamplingParams(max_tokens=10, min_tokens=2),
    ]
    histories = [History([1, 2], 2, [0]), History([1, 2, 3], 2, [0, 4]), History([1, 2, 3, 4], 2, [0])]
    out = apply_logits_controls(logits.clone(), params, histories)
    expected = logits.clone()
    expected[0, 5] += 100
    expected[0, 7] -= 100
    expected[0, 9] += 0.5
    expected[1, 5] += 1.0
    expected[1, [0, 4]] = float("-inf")  # one output token of three: stop ids held back
    torch.testing.assert_close(out, expected)  # row 2 has its two tokens: nothing held back


def test_rows_without_controls_are_untouched_and_sampling_is_seed_stable():
    logits, params, histories = random_case(7)
    plain = SamplingParams(temperature=0.8, seed=3)
    mixed = [plain, params[1], SamplingParams(temperature=0.9, min_p=0.1, seed=4)]
    rows = torch.stack([logits[0], logits[1], logits[2]])
    hist = [histories[0], histories[1], histories[2]]
    for _ in range(3):
        alone = [
            sample(rows[i : i + 1].clone(), [p], [make_generator(p.seed, "cpu")], [hist[i]]).item()
            for i, p in enumerate(mixed)
        ]
        together = sample(rows.clone(), mixed, [make_generator(p.seed, "cpu") for p in mixed], hist).tolist()
        assert alone[0] == together[0] and alone[2] == together[2]
    min_p_row = vllm_min_p(rows[2:3] / 0.9, torch.tensor([0.1]))
    for seed in range(20):  # min_p only ever draws from what it keeps
        token = sample(rows[2:3].clone(), [SamplingParams(min_p=0.1, temperature=0.9)], [make_generator(seed, "cpu")])
        assert min_p_row[0, token.item()].isfinite()


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0),
        ("repetition_penalty", float("nan")),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("logit_bias", {5: 101}),
        ("logit_bias", {"5": 1}),
        ("logit_bias", [1, 2]),
        ("min_tokens", 17),
        ("min_tokens", -1),
        ("n", 0),
        ("include_stop_str_in_output", 1),
        ("skip_special_tokens", "no"),
    ],
)
def test_bad_values_name_their_field(field, value):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(max_tokens=16, **{field: value})
    assert e.value.param == field and field in str(e.value)


# ---- whole generations --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint, num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return transformers.GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32).eval()


def reference_greedy(hf_model, prompt, params, steps):
    """transformers' logits, vLLM's formulas (above), argmax: one token at a time, whole forward each step."""
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[:, -1].float()
        for token, bias in (params.logit_bias or {}).items():
            logits[0, token] += bias
        logits = vllm_apply_penalties(
            logits,
            padded([prompt]),
            padded([ids[len(prompt) :]]),
            torch.tensor([params.presence_penalty]),
            torch.tensor([params.frequency_penalty]),
            torch.tensor([params.repetition_penalty]),
        )
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "controls",
    [
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"presence_penalty": -1.0, "repetition_penalty": 0.7, "logit_bias": {3: 2.0, 11: -4.0}},
    ],
)
def test_greedy_generation_matches_transformers_with_the_formula(llm, hf_model, controls):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in (5, 40, 23)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, **controls)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(hf_model, prompt, params, 20)
    # transformers' own greedy search has the repetition penalty: the same tokens again.
    if set(controls) == {"repetition_penalty"}:
        ids = torch.tensor([prompts[1]])
        hf = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                               repetition_penalty=1.8, pad_token_id=0)
        assert outs[1].token_ids == hf[0, len(prompts[1]) :].tolist()


def test_penalised_sampling_survives_batching_and_preemption(tiny_checkpoint, llm):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V - 1, (60,), generator=g).tolist() for _ in range(6)]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True, frequency_penalty=1.0,
                       repetition_penalty=1.3, min_p=0.05, logit_bias={7: 3.0})
        for i in range(6)
    ]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    alone = llm.generate(prompts[2:3], params[2:3], use_tqdm=False)[0]
    tight = LLM(tiny_checkpoint, num_kv_blocks=14, max_num_batched_tokens=64)  # 6 x 6 blocks don't fit
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_preemptions for o in squeezed) > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    assert alone.token_ids == roomy[2].token_ids


def test_min_tokens_holds_back_stop_tokens_and_strings(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    prompt = [1, 2, 3]
    forced = SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 100})
    assert llm.generate([prompt], forced, use_tqdm=False)[0].token_ids == [eos]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 100}, min_tokens=5),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"
    stop = SamplingParams(max_tokens=12, temperature=0, logit_bias={9: 100}, stop_token_ids=[9], min_tokens=3)
    assert llm.generate([prompt], stop, use_tqdm=False)[0].token_ids[-1] == 9
    assert len(llm.generate([prompt], stop, use_tqdm=False)[0].token_ids) == 4
    text = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0].text
    first = llm.tokenizer.decode(llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0].token_ids)
    s = first.strip()  # a stop string made of the first token's text: min_tokens keeps it from ending at once
    assert s
    early = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[s]),
                         use_tqdm=False)[0]
    late = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[s],
                                                 min_tokens=8), use_tqdm=False)[0]
    assert len(early.token_ids) == 1 and len(late.token_ids) == 8 and late.text == text


def test_a_stop_string_counts_where_it_ends_in_new_text(llm):
    """Past min_tokens, a stop string ends the output where it ends in a new token's text, as vLLM's
    check_stop_strings searches: one wholly in the text made before (when stop strings did not count yet)
    does not, however long another stop string is, and the text already streamed is never cut back."""
    (token,) = llm.tokenizer.encode("ken")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={token: 100}, min_tokens=3,
                            stop=["k", "a longer stop string"])
    sched = llm.scheduler
    request_id = sched.add_request(prompt_token_ids=[1, 2, 3], sampling_params=params)
    streamed = ""
    while sched.has_unfinished():
        sched.step()
        streamed += "".join(d.text for d in sched.get_new_outputs(request_id))
    out = sched.pop_response(request_id)
    assert out.token_ids == [token] * 4 and out.finish_reason == "stop"
    assert out.text == streamed == "ken" * 3

def test_include_stop_str_and_skip_special_tokens(llm, tiny_checkpoint):
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    ids = tokenizer.encode("once upon a time there was")
    for include, expected in ((False, "once upon"), (True, "once upon a t")):
        stream = TextStream(tokenizer.detokenizer(), [" a t"], include_stop=include)
        assert any(stream.add_token(t) for t in ids)
        assert stream.text == expected
    eos = llm.tokenizer.eos_token_ids[0]
    shown = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={eos: 100}, skip_special_tokens=False)
    hidden = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={eos: 100})
    special = llm.tokenizer.id_to_token(eos)
    assert llm.generate([[1, 2]], shown, use_tqdm=False)[0].text == special * 3
    assert llm.generate([[1, 2]], hidden, use_tqdm=False)[0].text == ""
    with_stop_token = SamplingParams(max_tokens=3, temperature=0, logit_bias={eos: 100}, skip_special_tokens=False,
                                     include_stop_str_in_output=True)
    assert llm.generate([[1, 2]], with_stop_token, use_tqdm=False)[0].text == special


def test_unknown_logit_bias_token_is_refused(llm):
    with pytest.raises(InvalidParameter, match="logit_bias token id 512") as e:
        llm.scheduler.add_request(prompt_token_ids=[1], sampling_params=SamplingParams(logit_bias={512: 1}))
    assert e.value.param == "logit_bias"


def test_unknown_stop_token_is_refused(llm):
    with pytest.raises(InvalidParameter, match="stop_token_ids token id 512") as e:
        llm.scheduler.add_request(prompt_token_ids=[1], sampling_params=SamplingParams(stop_token_ids=[3, 512]))
    assert e.value.param == "stop_token_ids"
