"""The gateway's one conversation model: what every protocol's request is translated into.

Data flow: a protocol module (protocols/*.py) validates its wire request and builds a
`Conversation`; `Gateway.complete`
(core.py) renders it with the renderer, dispatches, records and parses it, and hands back a
`Result` that the protocol turns into its own response. Nothing below the protocol modules knows
a wire format.

Conventions:
- Roles are "system", "user", "assistant", "tool". A system prompt given outside the messages
  (Anthropic `system`, Responses `instructions`) becomes a leading system message; chat's
  "developer" role is "system". A system message may stand anywhere (Anthropic's
  mid-conversation system, Responses developer items); templates.fit_system renders it.
- Content is text: protocols join their text parts and refuse the parts a text model cannot
  read (images, audio, files) with a 400 naming the part.
- A tool call's `arguments` is JSON text (what the OpenAI wire formats carry); protocols whose
  arguments are objects (Anthropic `input`) serialise them with `json.dumps`.
- Reasoning (chat `reasoning_content`, Responses `reasoning` items, Anthropic `thinking`) is the
  assistant message's `reasoning`; a renderer whose template has no reasoning slot (ChatML)
  does not render it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant message.

    name: the declared tool's name. arguments: JSON text of the arguments object (may be
    unparsable when a client sends it so; renderers then render it verbatim). id: the call id
    tool results refer to ("" when the client sent none).
    """

    name: str
    arguments: str = "{}"
    id: str = ""


@dataclass(frozen=True)
class Message:
    """One message of a conversation.

    content: the text ("" for none). tool_calls: on assistant messages, in order.
    tool_call_id: on tool messages, the call this result answers. reasoning: an assistant
    message's reasoning text, None when it has none. reasoning_signature: the opaque signature a
    client sent with that reasoning (Anthropic `thinking.signature`), kept as sent, never rendered.
    """

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_signature: str | None = None


SCHEMA_FIRST = ("type", "description", "properties", "required")
"""JSON-Schema keywords that come first, in this order (`canonical_schema`); the rest sorted."""
_SUBSCHEMA = frozenset({"items", "additionalProperties", "additionalItems", "not", "if", "then",
                        "else", "contains", "propertyNames", "unevaluatedItems",
                        "unevaluatedProperties", "contentSchema"})
_SUBSCHEMAS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions",
                    "dependentSchemas", "dependencies"})


def canonical_schema(schema: Any) -> Any:
    """`schema` with its keywords in one order, recursively (CASES.md C15): `SCHEMA_FIRST`, then
    the other keywords sorted, in the schema and every subschema. The names inside
    `properties` (and `$defs`, `patternProperties`, ...) keep the client's order: it is the
    argument order the model is shown. Lists (`required`, `enum`, `anyOf`) and values
    (`default`, `const`, `examples`) are kept as given. Anything that is not a schema object
    where one is expected is returned unchanged (validation reports it, prepare.tool_problem).
    """
    if not isinstance(schema, Mapping):
        return schema
    order = [k for k in SCHEMA_FIRST if k in schema] + sorted(
        k for k in schema if k not in SCHEMA_FIRST)
    out: dict[str, Any] = {}
    for k in order:
        v = schema[k]
        if k in _NAMED and isinstance(v, Mapping):
            v = {name: canonical_schema(sub) for name, sub in v.items()}
        elif k in _SUBSCHEMA or (k in _SUBSCHEMAS and isinstance(v, list)):
            v = [canonical_schema(sub) for sub in v] if isinstance(v, list) else (
                canonical_schema(v))
        out[k] = v
    return out


@dataclass(frozen=True)
class Tool:
    """A declared function tool, in one canonical shape for every protocol (chat `function`,
    `strict` or not, Responses flat `function`, Anthropic `input_schema` all map here), so
    that every spelling of one tool renders the same prompt ids (CASES.md C15).

    parameters: the JSON schema of the arguments object (None: no schema given), its keywords
    put in canonical order (`canonical_schema`) whatever order the client sent.
    """

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameters", canonical_schema(self.parameters))


@dataclass(frozen=True)
class ForcedTool:
    """`tool_choice` naming one tool: the reply must call exactly this tool."""

    name: str


ToolChoice = Literal["auto", "none", "required"] | ForcedTool


@dataclass(frozen=True)
class Sampling:
    """What the client asked for; None / empty = not set (the session, then the gateway
    defaults apply: see `prepare.sampling_params`).

    max_tokens: completion tokens per choice. stop: strings that end a choice (the returned
    text ends before the first one; the sampled ids up to the token completing it are kept).
    seed: choice i of a call samples with seed + i (mod 2**63). top_k, min_p and the
    penalties: as `forgerl.types.SamplingParams` (None: neutral).
    """

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


@dataclass(frozen=True)
class ItemIds:
    """Ids a client sent back (NeMo-Gym) as those of the call that answered `messages[index]`;
    `param`: where they came from (e.g. "input.3")."""

    index: int
    prompt_ids: tuple[int, ...]
    generation_ids: tuple[int, ...]
    param: str


@dataclass(frozen=True)
class Conversation:
    """One model call in the internal form: the conversation so far and how to continue it.

    tools: declared tools (empty: none). tool_choice: "auto" (default), "none" (tools are
    neither rendered nor parsed), "required" or a `ForcedTool` (the reply is made to open a
    tool call). parallel_tool_calls: False ends a reply after its first tool call.
    n: choices to sample (each recorded as its own completion). logprobs: return the recorded
    logprob of every sampled token. top_logprobs: alternatives per token (the engines give
    none: > 0 is refused).
    param_names: this protocol's name for an internal field, used as the `param` of errors the
    core raises (e.g. {"stop": "stop_sequences"}); fields not listed keep their internal name,
    which is the Chat Completions name.
    request: JSON notes on the request as applied (fields.enforce: protocol, kept,
    approximated, left_out; context edits `applied`), recorded as `Completion.request`.
    """

    model: str
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    sampling: Sampling = Sampling()
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    param_names: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    request: dict[str, Any] = field(default_factory=dict)
    template_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Variables for the model's chat template (chat `chat_template_kwargs`, e.g.
    `{"enable_thinking": false}`), over the gateway's `[gateway] chat_template_kwargs`."""
    item_ids: ItemIds | None = None
    """The ids the latest reply carried back (Responses items), if any: `Session.item_plan`."""

    def param(self, name: str) -> str:
        """The client's name for internal field `name` (for error `param`s)."""
        return self.param_names.get(name, name)
