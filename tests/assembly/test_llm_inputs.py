"""LLM.generate takes prompts as users hold them: a text or ids given bare, any iterable of prompts, NumPy's and
torch's integers, vLLM's prompt dicts; use_tqdm as vLLM takes it. What is no prompt is refused naming it, and nothing is left
holding blocks."""

import numpy as np
import pytest
import torch
from engine_checks import assert_all_free
from tqdm import tqdm

from minfer import LLM, EngineConfig, SamplingParams
from minfer.errors import InvalidParameter

GREEDY3 = SamplingParams(max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint, num_kv_blocks=24)


def texts(llm, prompts, params=GREEDY3, use_tqdm=False):
    return [o.text for o in llm.generate(prompts, params, use_tqdm=use_tqdm)]


def test_prompts_in_every_shape_users_hold_them(llm):
    ids = [5, 9, 13]
    want = texts(llm, [ids])
    for same in (ids, tuple(ids), np.array(ids), torch.tensor(ids), [np.array(ids)], [torch.tensor(ids)],
                 [[np.int64(i) for i in ids]], [torch.tensor(ids, dtype=torch.int32)], [{"prompt_token_ids": ids}],
                 (p for p in [ids])):
        assert texts(llm, same) == want, same
    assert texts(llm, np.array([ids, ids])) == want * 2  # an array's rows are prompts
    text = texts(llm, ["Once upon"])
    assert texts(llm, "Once upon") == texts(llm, [{"prompt": "Once upon"}]) == text
    assert texts(llm, ["Once upon", ids]) == text + want
    assert texts(llm, []) == []
    assert_all_free(llm)


@pytest.mark.parametrize("prompts, message", [
    (None, "prompts must be a str, a list of token ids or a list of prompts, got NoneType"),
    (7, "got int"),
    ([b"abc"], r"prompts\[0\] must be a str or a list of token ids, got bytes"),  # not the ids 97, 98, 99
    (["a", 1.5], r"prompts\[1\] must be a str or a list of token ids, got float"),
    ([{"text": "a"}], r"prompts\[0\] must be .* got dict"),
    ([["a", "b"]], "prompt token id 'a' is not an int in the vocabulary"),
    ([[1.0, 2.0]], "prompt token id 1.0 is not an int in the vocabulary"),
    ([[True]], "prompt token id True is not an int in the vocabulary"),
    ([np.array([True, False])], "is not an int in the vocabulary"),
    ([[1, 10**30]], "prompt token id 1000000000000000000000000000000 is not in the vocabulary"),
])
def test_what_is_no_prompt_is_refused_naming_it(llm, prompts, message):
    with pytest.raises(InvalidParameter, match=message) as e:
        llm.generate(prompts, GREEDY3, use_tqdm=False)
    assert e.value.param == "prompt"
    assert_all_free(llm)


@pytest.mark.parametrize("params", ["x", {"max_tokens": 2}, [GREEDY3, "x"], [{"max_tokens": 2}]])
def test_sampling_params_of_another_type_are_refused(llm, params):
    prompts = ["a", "b"] if isinstance(params, list) else ["a"]
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams or a list of them"):
        llm.generate(prompts, params, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, got str"):
        llm.scheduler.add_request("a", sampling_params="x")  # the scheduler's own entry, as tutorials call it
    assert_all_free(llm)


def test_unknown_settings_are_named_with_the_nearest_known_one(tiny_checkpoint):
    with pytest.raises(TypeError, match="LLM got an unknown setting 'max_num_seq': did you mean 'max_num_seqs'?"):
        LLM(tiny_checkpoint, max_num_seq=2)
    with pytest.raises(TypeError, match=r"LLM got an unknown setting 'flux_capacitor' \(EngineConfig's fields"):
        LLM(tiny_checkpoint, flux_capacitor=1)
    with pytest.raises(TypeError, match=r"config must be an EngineConfig, got str \(a model name: LLM\(name\)\)"):
        LLM(config=str(tiny_checkpoint))
    with pytest.raises(TypeError, match=r"^an EngineConfig is given as LLM\(config=\.\.\.\), not as the model$"):
        LLM(EngineConfig(str(tiny_checkpoint)))


def test_use_tqdm_may_be_vllm_s_callable_that_makes_the_bar(llm):
    """vLLM's use_tqdm takes a callable (functools.partial(tqdm, leave=False)) that makes the bar: it is used."""
    made = []

    def make_bar(**kwargs):
        made.append(kwargs["total"])
        return tqdm(**kwargs, disable=True)

    assert texts(llm, ["a", "b"], use_tqdm=make_bar) == texts(llm, ["a", "b"])
    assert made == [2]
    assert_all_free(llm)


@pytest.mark.parametrize("use_tqdm", ["no", 0, None])
def test_use_tqdm_of_another_type_is_refused_naming_it(llm, use_tqdm):
    with pytest.raises(TypeError, match=f"use_tqdm must be a bool or a callable that makes a progress bar, got "
                                        f"{use_tqdm!r}"):
        llm.generate(["a", "b"], GREEDY3, use_tqdm=use_tqdm)
    with pytest.raises(TypeError, match="use_tqdm must be"):
        llm.chat([{"role": "user", "content": "a"}], GREEDY3, use_tqdm=use_tqdm)
    assert_all_free(llm)


def test_get_tokenizer_is_the_one_generate_encodes_and_decodes_with(llm):
    tokenizer = llm.get_tokenizer()  # vLLM's name for it
    ids = tokenizer.encode("Once upon")
    out = llm.generate("Once upon", GREEDY3, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and tokenizer.decode(out.token_ids) == out.text
