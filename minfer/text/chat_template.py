"""Chat templates: turn a list of messages into the prompt text a chat model was trained on.

A chat checkpoint ships its own template, a Jinja program in tokenizer_config.json's
`chat_template`. Qwen3's (ChatML) wraps each message as

    <|im_start|>user
    Hi!<|im_end|>

and, with `add_generation_prompt`, ends with `<|im_start|>assistant\\n` for the model
to continue; the model then ends its turn with `<|im_end|>`, so generation must stop
there (`stop_token_ids`). The template is untrusted code from the checkpoint: it runs
in Jinja's sandbox, with the same helpers transformers gives it (`raise_exception`,
`tojson`, `strftime_now`, `{% break %}` and `{% continue %}`, `{% generation %}`).

A checkpoint without a template (GPT-2) gets the plain rendering: one `role: content`
line per message, then `assistant:`.

A template that reads the variable `tools` renders a request's tool definitions (OpenAI's
`{"type": "function", "function": {...}}` list) where the model was trained to see them;
`supports_tools` says whether it does.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from ..errors import BadSetting, InvalidParameter
from .tokenizer_files import read_tokenizer_config, token_text

# Tokens chat templates end a turn with: a chat request stops on each one its template writes.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


# The names the render itself gives a template: a template variable (chat_template_kwargs) cannot replace them.
RENDER_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})


class ChatTemplateError(ValueError):
    """The template could not render these messages (it raised, or it is broken)."""


def render_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The rendering for models without a template: a `role: content` line per message, then `assistant:`."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt else "")


def opens_a_reply(add_generation_prompt: bool | None, continue_final_message: bool) -> bool:
    """vLLM's add_generation_prompt as given; left out (None), the opposite of continue_final_message: a reply
    opens an assistant message of its own unless it goes on with the last message's text."""
    return not continue_final_message if add_generation_prompt is None else add_generation_prompt


# Appended to the message a reply continues, to find where its text ends in the rendering (transformers' way, so
# the two cut alike): its trailing space tells whether the template stripped the text's end, as some do.
CONTINUE_MARK = "MINFER_CONTINUES_HERE "


FROM_CHECKPOINT = "the checkpoint's chat_template"  # where a template came from, for its errors
OPTION = "--chat-template"  # the server's flag for a template of one's own; LLM.chat's argument is `chat_template`


def _default_template(named: list, option: str) -> str:
    """tokenizer_config.json's list of named templates -> the one named "default". Without one, transformers
    refuses to render a chat: so does this, naming the templates there are, rather than render plain text."""
    names = [t.get("name") for t in named if isinstance(t, dict)]
    chosen = next((t.get("template") for t in named if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(chosen, str):
        raise ValueError(f"tokenizer_config.json lists chat templates named {', '.join(map(repr, names)) or 'nothing'}"
                         f", but none named 'default' holding a template: pick one with {option}")
    return chosen


class ChatTemplate:
    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None, stop_token_ids=(),
                 origin: str = FROM_CHECKPOINT):
        self.source = source  # None: the plain rendering
        self.special_tokens = special_tokens or {}  # bos_token, eos_token, ... as the template names them
        self.stop_token_ids = list(stop_token_ids)  # the end-of-turn tokens this template writes
        self._template = None
        self.supports_tools = False  # whether the template reads `tools`
        self.reads: frozenset[str] = frozenset()  # the variables it reads: what chat_template_kwargs may set
        if source is not None:
            from jinja2 import meta
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # transformers' environment (vLLM renders with it): loop controls, and its {% generation %} tag
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols", _generation_tag()])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            try:
                self._template = env.from_string(source)
                self.reads = frozenset(meta.find_undeclared_variables(env.parse(source)))
                self.supports_tools = "tools" in self.reads
            except TemplateError as e:
                raise ValueError(f"{origin} does not compile: {e}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path, tokenizer, override: str | None = None,
                 option: str = OPTION) -> "ChatTemplate":
        """tokenizer_config.json's chat_template (or chat_template.jinja beside it), else the plain one.
        `override` (a file, or the template itself) replaces the checkpoint's; `option`, what the caller calls it
        (the server's --chat-template, LLM.chat's chat_template), names it in errors."""
        d = Path(model_dir)
        config = read_tokenizer_config(d)
        source = config.get("chat_template")
        if isinstance(source, list) and override is None:  # several named templates: the "default" one
            source = _default_template(source, option)
        if source is None and (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if override is not None:
            source = read_template_option(override, option)
        if not isinstance(source, str):
            return cls(None)
        special = {k: t for k, v in config.items() if k.endswith("_token") and (t := token_text(v)) is not None}
        stops = [tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS if t in source]
        origin = FROM_CHECKPOINT if override is None else f"{option} {override!r}"
        return cls(source, special, [i for i in stops if i is not None], origin)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, variables: dict | None = None,
        tools: list[dict] | None = None, continue_final_message: bool = False,
    ) -> str:
        """The prompt text for these messages, ending where the assistant's reply begins; with
        `continue_final_message`, ending inside the last message, for the reply to go on with its text (then
        not `add_generation_prompt`). `variables` are more names the template reads (Qwen3's `enable_thinking`,
        for one); `tools`, the tool definitions, for a template that supports them. A "developer" message is a
        "system" one to a template that never names that role."""
        self._check_variables(variables or {})
        if continue_final_message and add_generation_prompt:
            raise InvalidParameter("continue_final_message", "'continue_final_message' and 'add_generation_prompt' "
                                   "are both true: a reply either continues the last message or opens one of its "
                                   "own; set add_generation_prompt false")
        if not continue_final_message:
            return self._render(messages, add_generation_prompt, variables, tools)
        last = messages[-1]
        text = self._render([*messages[:-1], {**last, "content": last["content"] + CONTINUE_MARK}], False,
                            variables, tools)
        mark = CONTINUE_MARK.rstrip()
        if mark not in text or last["content"].strip() not in text:
            raise InvalidParameter("continue_final_message", "'continue_final_message': this chat template does not "
                                   f"write the last message's text (a {last['role']} message) as it is, so a reply "
                                   "cannot continue it")
        at = text.rindex(mark)
        return text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()  # as the template trims it

    def _check_variables(self, variables: dict) -> None:
        """chat_template_kwargs must name what the template reads, and not what the render itself gives it."""
        taken = sorted(RENDER_NAMES & variables.keys())
        if taken:  # the render's own would win over them unseen
            raise InvalidParameter(f"chat_template_kwargs.{taken[0]}", f"'chat_template_kwargs.{taken[0]}' names "
                                   "what the request itself gives the template: leave it out")
        unread = sorted(variables.keys() - self.reads)
        if unread:  # it would be accepted and change nothing
            param = f"chat_template_kwargs.{unread[0]}"
            why = ("this model has no chat template (its messages render as `role: content` lines), so no variable "
                   "applies") if self._template is None else "this model's chat template never reads it"
            raise InvalidParameter(param, f"'{param}' cannot apply: {why}", "unsupported_parameter")

    def _render(self, messages: list[dict], add_generation_prompt: bool, variables: dict | None,
                tools: list[dict] | None) -> str:
        if self._template is None:
            return render_chat(messages, add_generation_prompt)
        from jinja2.exceptions import TemplateError

        if "developer" not in self.source:  # OpenAI's developer messages are the system's instructions: a
            # template that never names the role would drop them unseen (Qwen3's) or refuse them
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        try:
            context = {**self.special_tokens, **(variables or {})}
            # tools None when there are none, as transformers renders them: templates test `if tools`. And
            # documents None: minfer takes none (vLLM's `documents` field is refused), but templates test them.
            return self._template.render(context, messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt)
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template could not render these messages: {e}") from None

    def without_thinking(self, variables):
        """The variables to render a constrained reply with. Qwen3's template opens its reply with a <think>
        block unless `enable_thinking` is false, and a constrained reply must start as its grammar wants: where
        the template reads it and the caller did not set it, it is false. A wrong kind is render's to refuse."""
        if "enable_thinking" not in self.reads or not isinstance(variables, (dict, type(None))):
            return variables
        return variables if "enable_thinking" in (variables or {}) else {**(variables or {}), "enable_thinking": False}

    def ending_turns(self, params):
        """`params` (SamplingParams) stopping at this template's end-of-turn tokens too: the reply ends with its
        turn, unless the params ignore EOS."""
        if not self.stop_token_ids or params.ignore_eos:
            return params
        return replace(params, stop_token_ids=[*(params.stop_token_ids or ()), *self.stop_token_ids])


def read_template_option(value: str, option: str = OPTION) -> str:
    """The value of `option` (--chat-template, or LLM.chat's chat_template): a file holding the template, or the Jinja
    template itself."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{option} {value!r} cannot be read as UTF-8 text: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{option} {value!r} is neither a file nor a Jinja template (no {{{{ or {{% in it)")


def check_template_option(value: str) -> None:
    """--chat-template's value read and compiled before the model loads: else a bad flag (BadSetting)."""
    try:
        ChatTemplate(read_template_option(value), origin=f"{OPTION} {value!r}")
    except ValueError as e:
        raise BadSetting(str(e)) from None


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: JSON as json.dumps writes it (Jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_tag():
    """The Jinja extension for transformers' `{% generation %}...{% endgeneration %}`: it marks the assistant's
    text for training masks, so here it renders its body as it is (in a scope of its own, as there)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    return GenerationTag
