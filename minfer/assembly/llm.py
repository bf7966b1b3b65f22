"""LLM: offline batch generation on top of the OnlineScheduler.

    from minfer import LLM, SamplingParams
    llm = LLM("gpt2")
    for out in llm.generate(["Hello, my name is", "The sky is"], SamplingParams(temperature=0)):
        print(out.text)
"""

from __future__ import annotations

import difflib
import logging
import operator
import os
from collections.abc import Callable
from dataclasses import fields, replace

from tqdm import tqdm

from ..engine.config import EngineConfig
from ..errors import InvalidParameter
from ..engine.generation_defaults import sampling_defaults
from ..engine.sampling_params import SamplingParams
from ..engine.outputs import RequestOutput
from ..text.chat_template import ChatTemplate, opens_a_reply
from ..text.message_checks import checked_messages
from ..text.tokenizer import Tokenizer
from ..text.tool_checks import check_tools
from .build import build_engine

log = logging.getLogger("minfer")


class LLM:
    """`LLM(model, **settings)` or `LLM(config=EngineConfig(...))`: settings are EngineConfig's fields
    (block_size=, max_num_seqs=, dtype=, ...); given with a config, they override it."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **settings):
        if isinstance(model, EngineConfig):
            raise TypeError("an EngineConfig is given as LLM(config=...), not as the model")
        if model is not None:
            settings["model"] = model
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__} (a model name: LLM(name))")
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(settings.keys() - known)
        if unknown:  # the first, by name: the same message however the kwargs were ordered
            near = difflib.get_close_matches(unknown[0], known, n=1)
            raise TypeError(f"LLM got an unknown setting {unknown[0]!r}" + (f": did you mean {near[0]!r}?" if near
                            else " (EngineConfig's fields are the settings)"))
        config = replace(config or EngineConfig(), **settings)
        self.scheduler = build_engine(config)  # the model loaded and prepared, every feature attached
        self.model, self.tokenizer = self.scheduler.model, self.scheduler.tokenizer
        self.sampling_defaults, not_applied = sampling_defaults(self.model.model_dir, config.generation_config)
        if not_applied:  # as the server's banner says: reported, never silently dropped
            log.warning("minfer: generation_config.json: not applied: %s", ", ".join(not_applied))

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer generate() encodes text prompts with and decodes outputs with (vLLM's LLM.get_tokenizer):
        encode(text) -> ids, decode(ids) -> text."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() samples with when given no SamplingParams: the checkpoint's
        generation_config.json settings under --generation-config auto (the default), as in vLLM."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, all together; results (text, token_ids, prompt_token_ids,
        finish_reason, ...) come back in prompt order: with SamplingParams(n=...), n per prompt, one per
        choice, in `index` order. A prompt is a text or its token ids (prompt_list says every form taken);
        sampling_params is one for every prompt or a list of one per prompt. use_tqdm, as vLLM's, may be what
        makes the progress bar (functools.partial(tqdm, leave=False))."""
        check_use_tqdm(use_tqdm)
        prompts = prompt_list(prompts)
        sampling_params = self._params_per_prompt(sampling_params, len(prompts))
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                if isinstance(prompt, str):
                    ids.append(self.scheduler.add_request(prompt, sampling_params=params))
                else:
                    ids.append(self.scheduler.add_request(prompt_token_ids=prompt, sampling_params=params))
            with progress_bar(use_tqdm, len(ids)) as bar:
                for _ in self.scheduler.steps():
                    bar.update(len(self.scheduler.pop_finished_ids()))
            return [out for i in ids for out in self.scheduler.pop_responses(i)]
        finally:  # an error (or Ctrl-C) must not leave requests holding KV blocks
            for i in ids:
                self.scheduler.discard_request(i)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        chat_template: str | os.PathLike | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of OpenAI's messages) or a list of them, each checked and
        rendered through the checkpoint's chat template (one `role: content` line each where it has none) and
        answered to the end of the assistant's turn, as the server's /v1/chat/completions does: the same checks,
        in the same words (a second conversation's faults are named messages[1][...]).
        `chat_template` (a file, or the template itself) replaces the checkpoint's; `chat_template_kwargs` are
        more names the template reads (Qwen3's {"enable_thinking": False}, as the server's, the default under
        structured outputs). continue_final_message has the reply go on with the last message's text;
        add_generation_prompt, the assistant's header, defaults to its opposite (both true is an error), as the
        server's fields do. `tools`, OpenAI's function definitions, render into
        the template as the server's do; a reply that calls one holds the call as text, in the template's format
        (docs/structured_outputs.md), as vLLM's LLM.chat returns it."""
        add_generation_prompt = opens_a_reply(add_generation_prompt, continue_final_message)
        _check_chat_arguments(chat_template, chat_template_kwargs, add_generation_prompt, continue_final_message)
        conversations = _conversations(messages)
        template = ChatTemplate.from_dir(self.model.model_dir, self.tokenizer,
                                         override=None if chat_template is None else os.fspath(chat_template),
                                         option="chat_template")
        if tools is not None and not (isinstance(tools, list) and not tools):  # `[]` renders none, as the server's
            check_tools(tools, template)
            _refuse_strict(tools)
        per_prompt = self._params_per_prompt(sampling_params, len(conversations))
        prompts = [self.tokenizer.encode(template.render(
            checked_messages(c, template, add_generation_prompt, name), add_generation_prompt,
            chat_template_kwargs if p.structured_outputs is None else template.without_thinking(chat_template_kwargs),
            tools or None, continue_final_message,
        )) for (name, c), p in zip(conversations, per_prompt)]  # the template writes BOS where it wants one
        return self.generate(prompts, [template.ending_turns(p) for p in per_prompt], use_tqdm)

    def _params_per_prompt(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        """One SamplingParams per prompt: the one given for all, the checkpoint's defaults if none, or the list."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * num_prompts
        listed = isinstance(sampling_params, (list, tuple))
        if not listed or not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {sampling_params!r:.200}")
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling params for {num_prompts} prompts")
        return list(sampling_params)

    def stats(self) -> dict:
        return self.scheduler.stats()

    def close(self) -> None:
        """Release the engine's CUDA graphs and their memory (vLLM frees them at shutdown). The model and its
        cache go with the last reference to this LLM, as any tensor does."""
        self.scheduler.close()


def check_use_tqdm(use_tqdm) -> None:
    if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
        raise TypeError(f"use_tqdm must be a bool or a callable that makes a progress bar, got {use_tqdm!r:.100}")


def progress_bar(use_tqdm: bool | Callable[..., tqdm], total: int) -> tqdm:
    """generate()'s bar over its requests: tqdm's, or the one use_tqdm makes; none for one request (nothing to
    count)."""
    if use_tqdm is False or total <= 1:
        return tqdm(total=total, disable=True)
    return (tqdm if use_tqdm is True else use_tqdm)(total=total, desc="generate", unit="req")


def _check_chat_arguments(chat_template, chat_template_kwargs, add_generation_prompt, continue_final_message):
    """A TypeError naming the argument of chat() that is of another type (a string would count as a true flag)."""
    if chat_template is not None and not isinstance(chat_template, (str, os.PathLike)):
        raise TypeError(f"chat_template must be a Jinja template, or the path of a file holding one, "
                        f"got {chat_template!r:.100}")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict of the variables the template reads, "
                        f"got {chat_template_kwargs!r:.100}")
    for name, flag in (("add_generation_prompt", add_generation_prompt),
                       ("continue_final_message", continue_final_message)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r:.100}")


def _refuse_strict(tools: list[dict]) -> None:
    """A strict tool asks that the reply's calls be held to the tools, which the server does with its grammar
    (server/tool_calls.py) and chat() does not: refused, rather than rendered and not applied."""
    strict = next((i for i, tool in enumerate(tools) if tool["function"].get("strict") is True), None)
    if strict is not None:
        param = f"tools[{strict}].function.strict"
        raise InvalidParameter(param, f"'{param}' is true, but LLM.chat holds no reply to its tools (the server "
                               "does): leave it out, or hold the reply with SamplingParams(structured_outputs=...)",
                               "unsupported_parameter")


def _conversations(messages) -> list[tuple[str, object]]:
    """chat()'s messages as (what errors call it, conversation) pairs: one conversation is `messages`, as the
    server names it; a list of them (its first a list) is messages[0], messages[1], ..."""
    if isinstance(messages, list) and not messages:
        return []  # no conversations: no outputs, as generate([])
    if isinstance(messages, list) and isinstance(messages[0], list):
        return [(f"messages[{c}]", conversation) for c, conversation in enumerate(messages)]
    return [("messages", messages)]


def prompt_list(prompts) -> list[str | list[int]]:
    """generate()'s prompts as a list of texts and token-id lists. One prompt may come bare; a batch may be any
    iterable; ids may be NumPy's or torch's integers (an array or tensor too, one row a prompt); a prompt may be
    vLLM's {"prompt": text} or {"prompt_token_ids": ids}. Anything else is an InvalidParameter naming it."""
    if hasattr(prompts, "tolist"):  # a NumPy array or torch tensor of ids
        prompts = prompts.tolist()
    if prompts is None or isinstance(prompts, (bytes, dict)) or not hasattr(prompts, "__iter__"):
        raise InvalidParameter("prompt", f"prompts must be a str, a list of token ids or a list of prompts, "
                               f"got {type(prompts).__name__}")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if prompts and is_token_id(prompts[0]):
        prompts = [prompts]  # one prompt's ids, given bare
    return [_prompt(i, prompt) for i, prompt in enumerate(prompts)]


def _prompt(index: int, prompt) -> str | list[int]:
    if isinstance(prompt, dict) and len(prompt) == 1 and prompt.keys() <= {"prompt", "prompt_token_ids"}:
        prompt = next(iter(prompt.values()))  # vLLM's TextPrompt or TokensPrompt
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):  # bytes would read as ids
        raise InvalidParameter("prompt", f"prompts[{index}] must be a str or a list of token ids, "
                               f"got {type(prompt).__name__}")
    return [operator.index(t) if is_token_id(t) else t for t in prompt]  # the scheduler names what is not an id


def is_token_id(value) -> bool:
    """An int, or an integer scalar of NumPy or torch (operator.index takes it); a bool is no token id."""
    if isinstance(value, bool) or getattr(value, "dtype", None) == bool:
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True
