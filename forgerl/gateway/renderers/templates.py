"""The model's own chat template as the gateway renderer (Qwen, Llama, Mistral families ...).

Data flow: `build_renderer` (called where the controller builds the gateway) picks the renderer
for `[gateway] renderer` / `tool_parser`: ChatML with our Hermes tool section (renderer.py) for
SmolLM2-like tokenizers whose template has no tool section, else `HFTemplateRenderer`, which
renders with `tokenizer.apply_chat_template`. The template sees what an OpenAI-style client
sends: tools as `{"type": "function", "function": {name, description, parameters}}`, assistant
tool calls with `arguments` as an object (the client-visible message keeps the JSON text,
CASES.md C15) and reasoning as `reasoning_content`. Control-token strings inside messages and
tools are encoded as plain text (`sanitize_control_tokens`), so content never forges a turn.
A template that takes a system message only first gets the others as `fit_system` writes them.

Token-in-token-out (sessions.py): `continuation` renders the history with and without the new
messages and appends the difference after the recorded ids only when each rendering extends the
previous one id for id; a template that rewrites earlier turns (e.g. drops reasoning from
history) gives None, and the session starts a counted new branch instead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from forgerl.config import ConfigError
from forgerl.gateway.conversation import Message, Tool
from forgerl.gateway.errors import GatewayError, unsupported
from forgerl.gateway.renderers.renderer import END, START, ChatMLRenderer, Renderer, call_arguments
from forgerl.gateway.renderers.renderer import tool_signature as _signature
from forgerl.gateway.renderers.tool_parsers import PARSERS, ToolParser, detect_parser

END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                      "<|tool_response>")  # Gemma 4 ends a tool-call turn with <|tool_response>
"""Tokens that end a reply wherever a tokenizer has them (besides eos and the template's own)."""


def template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's chat template source ("" when it has none; named templates joined)."""
    t = tokenizer.chat_template
    return "\n".join(t.values()) if isinstance(t, dict) else (t or "")


SYSTEM_AS_USER = "[system] "
"""Prefix of a later system message rendered as a user message (`fit_system`)."""


def fit_system(messages: Sequence[Message]) -> list[Message]:
    """System messages as a template that takes one only first renders them: the leading ones
    merged into one (joined by a blank line), each later one a user message starting with
    `SYSTEM_AS_USER`. Message by message, so the rendering of a longer conversation still
    extends the shorter one's (token-in-token-out, `continuation`)."""
    lead = next((k for k, m in enumerate(messages) if m.role != "system"), len(messages))
    head = [Message("system", "\n\n".join(m.content for m in messages[:lead]))] if lead else []
    return head + [Message("user", SYSTEM_AS_USER + m.content) if m.role == "system" else m
                   for m in messages[lead:]]


def template_message(m: Message) -> dict[str, Any]:
    """One message as an OpenAI-style dict for the template (tool call arguments as objects)."""
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"type": "function", "id": c.id, "function": {
            "name": c.name, "arguments": call_arguments(c)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning is not None:
        d["reasoning_content"] = m.reasoning
    return d


class HFTemplateRenderer(Renderer):
    """Renders conversations with the tokenizer's own jinja chat template.

    Args:
        tokenizer: a HF tokenizer with a `chat_template`.
        parser: the tool-call format; default `detect_parser(template)`.

    end_of_turn_id: the special token the template puts right after an assistant message's
    content (or, when it closes none, GLM's, first in the next turn); stop_ids: it, `eos_ids`
    (the generation config's), eos and `END_OF_TURN_TOKENS` the tokenizer has. Raises ValueError
    when the tokenizer has no chat template or the template closes assistant turns with no
    special token.
    """

    takes_template_kwargs = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase, parser: ToolParser | None = None,
                 eos_ids: Sequence[int] = ()):
        self.tokenizer, self.template = tokenizer, template_text(tokenizer)
        if not self.template:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template")
        self.parser = parser or detect_parser(self.template)
        added = tokenizer.get_added_vocab()
        end = self._end_of_turn()
        self.end_of_turn_id = added.get(end, tokenizer.convert_tokens_to_ids(end))
        extra = [*eos_ids, tokenizer.eos_token_id,
                 *(added[t] for t in END_OF_TURN_TOKENS if t in added)]
        self.stop_ids = tuple(dict.fromkeys([self.end_of_turn_id, *(i for i in extra
                                                                     if i is not None)]))

    def _end_of_turn(self) -> str:
        """The first special token (named or an added one marked special, like `<turn|>`) after
        an assistant turn's content, else (GLM closes no turn) after it in the next turn."""
        tok, turns = self.tokenizer, [{"role": "user", "content": "u"},
                                      {"role": "assistant", "content": "PROBE"}]
        specials = {*tok.all_special_tokens,
                    *(t.content for t in tok.added_tokens_decoder.values() if t.special)}
        for probe in (turns, [*turns, turns[0]]):
            try:
                text = str(tok.apply_chat_template(probe, tokenize=False))
            except TemplateError as e:
                raise ValueError(f"the chat template fails on user + assistant: {e}") from None
            after = text[text.rfind("PROBE") + 5 :]
            found = sorted((after.find(t), t) for t in specials if t in after)
            if found:
                return found[0][1]
        raise ValueError("the chat template ends assistant turns with no special token")

    def decode(self, ids: list[int]) -> str:
        """Text of completion ids without the stop ids; other special tokens are kept as text
        (the tool parsers read `<|python_tag|>`, `[TOOL_CALLS]`)."""
        kept = [i for i in ids if i not in self.stop_ids]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    @functools.cached_property
    def late_system(self) -> bool:
        """Whether the template renders a system message that is not first (templates that take
        one only first refuse or drop it): probed once."""
        probe = "q7x9zs"
        try:
            return probe in self.tokenizer.decode(self._render(
                [Message("user", "a"), Message("system", probe), Message("user", "b")]))
        except GatewayError:  # the template refuses it
            return False

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] = (),
               add_generation_prompt: bool = True) -> list[int]:
        """`tokenizer.apply_chat_template` ids of the conversation (control strings in content
        are plain text), its system messages fitted (`fit_system`) unless `late_system`.
        Raises GatewayError 400 when the template refuses it (its `raise_exception`) or tools
        are given to a template without a tool section."""
        fitted = messages if self.late_system else fit_system(messages)
        return self._render(fitted, tools, add_generation_prompt)

    def _render(self, messages: Sequence[Message], tools: Sequence[Tool] = (),
                add_generation_prompt: bool = True) -> list[int]:
        if tools and "tools" not in self.template:
            raise unsupported("tools", "this model's chat template has no tool section")
        try:
            ids = self.tokenizer.apply_chat_template(
                [template_message(m) for m in messages],
                tools=[{"type": "function", "function": _signature(t)} for t in tools] or None,
                add_generation_prompt=add_generation_prompt, sanitize_control_tokens=True,
                return_dict=False, **self.template_kwargs)
        except (TemplateError, ValueError) as e:  # ValueError: e.g. an empty conversation
            raise GatewayError(400, f"the model's chat template refused the conversation: {e}",
                               "invalid_request_error", "messages") from None
        return list(ids)

    def continuation(self, history: Sequence[Message], new: Sequence[Message],
                     tools: Sequence[Tool], completion_ids: list[int]) -> list[int] | None:
        """render(all) after the reply's end: its first stop id after render(history[:-1]) in
        render(history) (not what only a last turn gets, Phi-3.5's eos), else (GLM) the next
        turn's opening stop id. None unless render(all) starts with the reply's rendering."""
        prompt = self.render(history[:-1], tools)
        before = self.render(history, tools, add_generation_prompt=False)
        after = self.render([*history, *new], tools)
        if before[: len(prompt)] != prompt:
            return None
        end = next((k for k in range(len(prompt), len(before)) if before[k] in self.stop_ids),
                   len(before))
        if after[:end] != before[:end] or len(after) <= end or after[end] not in self.stop_ids:
            return None
        if not completion_ids or completion_ids[-1] not in self.stop_ids:
            return after[end:]  # the reply was cut (length): its end-of-turn id is added
        return after[end + 1 :] if end < len(before) or completion_ids[-1] == after[end] else None


def build_renderer(tokenizer: PreTrainedTokenizerBase, renderer: str = "auto",
                   tool_parser: str = "auto", default_system: str | None = None,
                   eos_ids: Sequence[int] = ()) -> Renderer:
    """The renderer for `[gateway] renderer` and `tool_parser` (see GatewayConfig); `eos_ids`
    (the model's generation_config eos ids) are stop ids too.

    "auto": `ChatMLRenderer` (Hermes tools, `default_system`) when the tokenizer has
    `<|im_start|>`/`<|im_end|>` and its template has no tool section (SmolLM2), else
    `HFTemplateRenderer`. Raises ConfigError (one line) when the choice cannot be built.
    """
    text, added = template_text(tokenizer), tokenizer.get_added_vocab()
    if renderer == "auto":
        chatml = START in added and END in added and "tools" not in text
        renderer = "chatml_hermes" if chatml else "hf_template"
    parser = None if tool_parser == "auto" else PARSERS[tool_parser]
    try:
        if renderer == "hf_template":
            return HFTemplateRenderer(tokenizer, parser, eos_ids)
        if parser not in (None, PARSERS["hermes"]):
            raise ValueError(f"its tool section asks for hermes calls, not {tool_parser!r}")
        (chatml := ChatMLRenderer(tokenizer, default_system)).stop_ids += tuple(
            i for i in dict.fromkeys(eos_ids) if i not in chatml.stop_ids)
        return chatml
    except ValueError as e:
        raise ConfigError(f"gateway.renderer: {renderer!r} cannot be used: {e}") from None
