"""Completion text -> tool calls, one parser per model family's tool-call format.

Data flow: the gateway decodes the sampled ids and parses them here only to answer the client;
the recorded token ids never depend on the parse. The renderer names its parser
(`Renderer.parser`): ChatML and Qwen-family templates use `hermes`, Llama 3.x `llama3_json`,
Mistral `mistral`, and the formats below (`detect_parser` reads the chat template;
`[gateway] tool_parser` overrides).

    hermes       <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (several per reply)
    llama3_json  {"name": ..., "parameters": {...}}, the whole reply, maybe after <|python_tag|>
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abc123XYZ"}, ...]
    qwen3_coder  <tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>
                 \n</tool_call>
    glm45        <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>
    kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
                 <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>
    deepseek     <|tool calls begin|><|tool call begin|>NAME<|tool sep|>{...}<|tool call end|>
                 ...<|tool calls end|> (R1/V3: function<|tool sep|>NAME\n```json\n{...}\n```);
                 written with fullwidth bars and U+2581 for the spaces
    gemma4       <|tool_call>call:NAME{k:<|"|>text<|"|>,n:3}<tool_call|>

The XML formats write string values bare: a value is typed by the declared tool's parameters
schema (`Declared` as a mapping). Ids: Kimi's sampled id (`functions.NAME:0`) is the call's id,
so the next prompt renders it token-exact; the others are minted, unique ("call_" + 24 hex).

A parse never raises: a call with invalid JSON, a missing name or an undeclared tool stays in
`content` as text and is reported in `errors` (CASES.md C05; a mistral list with a valid call
keeps only that call and reports the rest). An unclosed `<tool_call>` (a reply truncated by
max_tokens, C09) also stays as text; the gateway keeps that turn's finish_reason "length".
Streaming: a call (or a section of calls: kimi_k2, deepseek) is recognised as soon as its block
closes (`ToolParser.open`/`close`); llama3_json and mistral calls
have no closing string, so a stream with tools holds their reply back and parses it once, when
it ends (`replies.HeldReply`), giving the same content and calls as the non-streamed reply.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from forgerl.gateway.conversation import ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, MISTRAL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"
KIMI_OPEN, KIMI_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
DS_OPEN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"  # DeepSeek: fullwidth bars, U+2581
DS_CLOSE = "<\uff5ctool\u2581calls\u2581end\uff5c>"
GEMMA_OPEN, GEMMA_CLOSE, GEMMA_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
Declared = Collection[str] | Mapping[str, Any] | None
"""The declared tools: their names, or name -> parameters JSON schema (typed argument values
of the XML formats); None accepts any name."""



@dataclass
class ParsedReply:
    """content: the text outside valid tool calls (None when empty and calls were found; with
    calls, trailing whitespace and line breaks that start text after a call stripped).
    tool_calls: `ToolCall`s (arguments JSON text), in reply order; ids "call_" + 24 hex digits
    (mistral: the model's 9-character id, else 9 random letters and digits).
    errors: one line per call kept as text."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


Body = Callable[[str, Declared], tuple[list[ToolCall], str]]
"""One block's text -> its calls, or ([], the error that keeps the block as text)."""


def _hermes_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, declared: Declared, call_id: str) -> tuple[ToolCall | None, str]:
    """One decoded call object -> (tool call, "") or (None, error message)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, "tool call is not an object with a string 'name'"
    name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    if args is None or args == "":  # a call with no arguments (CASES.md C14)
        args = {}
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # malformed, too deep, a > 4,300-digit integer
            return None, f"arguments of {name!r} are not a JSON object"
    if not isinstance(args, dict):
        return None, f"arguments of {name!r} are not a JSON object"
    if declared is not None and name not in declared:
        return None, f"tool {name!r} was not declared in the request"
    return ToolCall(name, json.dumps(args, ensure_ascii=False), call_id), ""


def _loads(body: str) -> tuple[Any, str]:
    """(decoded JSON, "") or (None, error message)."""
    try:
        return json.loads(body), ""
    except json.JSONDecodeError as e:
        return None, f"invalid JSON in tool call: {e.msg} at char {e.pos}"
    except (ValueError, RecursionError) as e:  # nested too deeply, a > 4,300-digit integer
        return None, f"invalid JSON in tool call: {e}"


@functools.cache
def _block(open_: str, close: str) -> re.Pattern[str]:
    """One `open_ ... close` block; its body never holds another `open_` (an unclosed block must
    not swallow the next valid one, C05)."""
    o, c = re.escape(open_), re.escape(close)
    return re.compile(f"{o}((?:(?!{o}).)*?){c}", re.DOTALL)


def parse_blocks(text: str, declared: Declared, open_: str, close: str, body: Body,
                 ) -> ParsedReply:
    """Split a reply into text and the tool calls of its `open_ ... close` blocks, in order:
    `body(block text, declared)` gives a block's calls, or an error (the block stays text)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept: list[str] = []
    pos, lead = 0, ""
    for m in _block(open_, close).finditer(text):
        kept.append(text[pos : m.start()])
        found, err = body(m.group(1), declared)
        if err:
            kept.append(m.group(0))
            errors.append(err)
        else:
            if not calls:
                lead = "".join(kept)  # the text before the first call
            calls += found
        pos = m.end()
    kept.append(text[pos:])
    for _ in range(sum(seg.count(open_) for seg in kept) - len(errors)):
        errors.append(f"unclosed {open_} (reply truncated?)")
    content = "".join(kept)
    if calls:  # trailing whitespace goes, and line breaks that start text after a call; a
        # space there is the model's (CASES.md C14: " All done.")
        content = (content.lstrip("\r\n") if not lead.strip() else content).rstrip()
    return ParsedReply(content=content or (None if calls else ""), tool_calls=calls, errors=errors)


def _json_call(text: str, declared: Declared, call_id: str, name: str | None = None,
               ) -> tuple[ToolCall | None, str]:
    """A call written as JSON text: the whole call object, or (`name` given) its arguments."""
    obj, err = _loads(text.strip())
    if err:
        return None, err
    return _call(obj if name is None else {"name": name, "arguments": obj}, declared, call_id)


def _section(items: list[tuple[str, str, str]], declared: Declared,
             ) -> tuple[list[ToolCall], str]:
    """A section of calls, each (name, JSON arguments text, id): all of them, or ([], the first
    error: the section stays text)."""
    calls = []
    for name, args, call_id in items:
        call, err = _json_call(args, declared, call_id, name)
        if call is None:
            return [], err
        calls.append(call)
    return (calls, "") if calls else ([], "no call in the tool-call section")


def _hermes_body(body: str, declared: Declared) -> tuple[list[ToolCall], str]:
    call, err = _json_call(body, declared, _hermes_id())
    return ([call] if call else []), err


def parse_tool_calls(text: str, declared: Declared = None) -> ParsedReply:
    """Split a reply into text and Hermes tool calls (several per reply, in order).

    declared: the tool names the request offered (a mapping: name -> parameters schema);
    None accepts any name.
    """
    return parse_blocks(text, declared, CALL_OPEN, CALL_CLOSE, _hermes_body)


def parse_llama3_json(text: str, declared: Declared = None) -> ParsedReply:
    """A Llama 3.x reply that is one JSON call object (`parameters` or `arguments`), maybe after
    text and `<|python_tag|>`; a reply not starting with "{" (after the tag) is plain text."""
    head, tag, body = text.partition(PYTHON_TAG)
    if not tag:
        head, body = "", text
    if not body.strip().startswith("{"):
        return ParsedReply(text)
    call, err = _json_call(body, declared, _hermes_id())
    if call is None:
        return ParsedReply(text, errors=[err])
    return ParsedReply(head.strip() or None, [call])


def _mistral_id(obj: Any) -> str:
    given = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(given, str) and len(given) == 9 and given.isalnum():
        return given  # Mistral templates insist on 9 alphanumeric characters
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def parse_mistral(text: str, declared: Declared = None) -> ParsedReply:
    """A Mistral reply: optional text, then `[TOOL_CALLS]` and a JSON list of call objects."""
    head, tag, body = text.partition(MISTRAL_CALLS)
    if not tag:
        return ParsedReply(text)
    objs, err = _loads(body.strip())
    if err:
        return ParsedReply(text, errors=[err])
    calls, errors = [], []
    for obj in objs if isinstance(objs, list) else [objs]:
        call, err = _call(obj, declared, _mistral_id(obj))
        if call is None:
            errors.append(err)
        else:
            calls.append(call)
    if not calls:
        return ParsedReply(text, errors=errors)
    return ParsedReply(head.strip() or None, calls, errors)


def _typed(raw: str, schema: Any) -> Any:
    """An XML-format argument value (qwen3_coder, glm45 write strings bare, other values as
    JSON, or as Python's str() for qwen3_coder) as the value its schema `type` asks for:
    "string" keeps the text; else JSON, then a Python literal, then the text."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return raw
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        pass
    return {"True": True, "False": False, "None": None}.get(raw, raw)  # Python's str()


def _xml_call(name: str, pairs: list[tuple[str, str]], declared: Declared,
              ) -> tuple[list[ToolCall], str]:
    name = name.strip()
    schema = declared.get(name) if isinstance(declared, Mapping) else None
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    props = props if isinstance(props, Mapping) else {}
    args = {k: _typed(v, props.get(k)) for k, v in pairs}
    call, err = _call({"name": name, "arguments": args}, declared, _hermes_id())
    return ([call] if call else []), err


QWEN3_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.DOTALL)
QWEN3_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _qwen3_coder_body(body: str, declared: Declared) -> tuple[list[ToolCall], str]:
    """`<function=name>\n<parameter=k>\nvalue\n</parameter>\n</function>` (Qwen3-Coder)."""
    m = QWEN3_FUNCTION.fullmatch(body)
    if m is None:
        return [], "tool call is not one <function=name>...</function>"
    return _xml_call(m[1], QWEN3_PARAMETER.findall(m[2]), declared)


GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_body(body: str, declared: Declared) -> tuple[list[ToolCall], str]:
    """`name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>...` (GLM-4.5/4.6)."""
    return _xml_call(body.split("<arg_key>", 1)[0], GLM_ARG.findall(body), declared)


KIMI_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)"
                       r"<\|tool_call_end\|>", re.DOTALL)


def _kimi_body(body: str, declared: Declared) -> tuple[list[ToolCall], str]:
    """Kimi-K2's section: `<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>
    {json}<|tool_call_end|>` per call; the sampled id (`functions.name:0`) is the call's id."""
    ids = [(raw.strip(), args) for raw, args in KIMI_CALL.findall(body)]
    return _section([(i.removeprefix("functions.").rsplit(":", 1)[0], args, i)
                     for i, args in ids], declared)


DS_CALL = re.compile("<\uff5ctool\u2581call\u2581begin\uff5c>(.*?)<\uff5ctool\u2581sep\uff5c>(.*?)"
                     "<\uff5ctool\u2581call\u2581end\uff5c>", re.DOTALL)
DS_FENCED = re.compile(r"([^\n]*)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)


def _deepseek_body(body: str, declared: Declared) -> tuple[list[ToolCall], str]:
    """DeepSeek's section: per call `<|tool call begin|>name<|tool sep|>{json}` (V3.1, V3.2)
    or `function<|tool sep|>name\n```json\n{json}\n```` (V3, R1), `<|tool call end|>`."""
    parts = [(f[1], f[2]) if (f := DS_FENCED.fullmatch(rest)) else (head, rest)
             for head, rest in DS_CALL.findall(body)]
    return _section([(name.strip(), args, _hermes_id()) for name, args in parts], declared)


GEMMA_LITERALS = {"true": True, "false": False, "None": None, "null": None}


def _gemma_value(s: str, i: int) -> tuple[Any, int]:
    """One Gemma 4 argument value at s[i:]: <|"|>text<|"|>, {key:value,...}, [..], a literal."""
    if s.startswith(GEMMA_QUOTE, i):
        j = s.index(GEMMA_QUOTE, i + len(GEMMA_QUOTE))
        return s[i + len(GEMMA_QUOTE) : j], j + len(GEMMA_QUOTE)
    if s[i] in "{[":
        obj, items, close = s[i] == "{", [], "}" if s[i] == "{" else "]"
        i += 1
        while s[i] != close:
            if obj:
                key, i = (_gemma_value(s, i) if s.startswith(GEMMA_QUOTE, i)
                          else (s[i : s.index(":", i)], s.index(":", i)))
                i += 1  # the ":"
            value, i = _gemma_value(s, i)
            items.append((key, value) if obj else value)
            i += s[i] == ","
        return (dict(items) if obj else items), i + 1
    j = min((k for k in (s.find(c, i) for c in ",}]") if k >= 0), default=len(s))
    raw = s[i:j].strip()
    return (GEMMA_LITERALS[raw] if raw in GEMMA_LITERALS else json.loads(raw)), j


def _gemma_body(body: str, declared: Declared) -> tuple[list[ToolCall], str]:
    """Gemma 4: `call:name{key:value,...}` (strings quoted by <|"|>)."""
    brace = body.find("{")
    if not body.startswith("call:") or brace < 0:
        return [], "tool call is not call:name{...}"
    try:
        args, end = _gemma_value(body, brace)
    except (ValueError, IndexError, RecursionError) as e:
        return [], f"invalid Gemma tool-call arguments: {e}"
    if body[end:].strip():
        return [], "text after the tool-call arguments"
    call, err = _call({"name": body[5:brace], "arguments": args}, declared, _hermes_id())
    return ([call] if call else []), err


def _blocks_parser(open_: str, close: str, body: Body,
                   ) -> Callable[[str, Declared], ParsedReply]:
    return lambda text, declared=None: parse_blocks(text, declared, open_, close, body)


@dataclass(frozen=True)
class ToolParser:
    """One family's tool-call format: how to parse it, stream it and force it.

    parse: `(text, declared names or None) -> ParsedReply`, never raising. open / close: the
    strings around one call (streaming recognises a call when `close` arrives; a reply limited
    to one call stops after `close`); None: no such string. prefix_any / prefix_named: reply
    text that opens a call of any tool / of tool `{name}` up to the brace of its arguments
    object (tool_choice "required" / named: the arguments cannot start with a non-object);
    None: the format cannot be forced. multiple: a reply may hold several calls.
    """

    name: str
    parse: Callable[[str, Declared], ParsedReply]
    open: str | None = None
    close: str | None = None
    prefix_any: str | None = None
    prefix_named: str | None = None
    multiple: bool = True

    def call_prefix(self, name: str | None) -> str | None:
        """The prefill that makes the reply a call of tool `name` (any tool when None), or None
        when this format cannot be forced."""
        text = self.prefix_any if name is None else self.prefix_named
        if text is None:
            return None
        return text.replace("{name}", json.dumps(name, ensure_ascii=False))


HERMES = ToolParser("hermes", parse_tool_calls, CALL_OPEN, CALL_CLOSE, f"{CALL_OPEN}\n",
                    f'{CALL_OPEN}\n{{"name": {{name}}, "arguments": {{')
LLAMA3_JSON = ToolParser("llama3_json", parse_llama3_json, prefix_any='{"name": ',
                         prefix_named='{"name": {name}, "parameters": {', multiple=False)
MISTRAL = ToolParser("mistral", parse_mistral)  # its opener is a control token: never prefilled
QWEN3_CODER = ToolParser("qwen3_coder", _blocks_parser(CALL_OPEN, CALL_CLOSE, _qwen3_coder_body),
                         CALL_OPEN, CALL_CLOSE)
GLM45 = ToolParser("glm45", _blocks_parser(CALL_OPEN, CALL_CLOSE, _glm_body), CALL_OPEN,
                   CALL_CLOSE)
KIMI_K2 = ToolParser("kimi_k2", _blocks_parser(KIMI_OPEN, KIMI_CLOSE, _kimi_body), KIMI_OPEN,
                     KIMI_CLOSE)
DEEPSEEK = ToolParser("deepseek", _blocks_parser(DS_OPEN, DS_CLOSE, _deepseek_body), DS_OPEN,
                      DS_CLOSE)
GEMMA4 = ToolParser("gemma4", _blocks_parser(GEMMA_OPEN, GEMMA_CLOSE, _gemma_body), GEMMA_OPEN,
                    GEMMA_CLOSE)
PARSERS = {p.name: p for p in (HERMES, LLAMA3_JSON, MISTRAL, QWEN3_CODER, GLM45, KIMI_K2,
                               DEEPSEEK, GEMMA4)}
"""Every tool-call format by its `[gateway] tool_parser` name."""


def detect_parser(template: str) -> ToolParser:
    """The parser a chat template's tool section asks for (hermes when it names none): the
    first of these its text holds: Kimi's section token, DeepSeek's, Gemma 4's `<|tool_call>`,
    `[TOOL_CALLS]`, GLM's `<arg_key>`, Qwen3-Coder's `<function=`, `<tool_call>`, Llama's
    `<|python_tag|>` or `"parameters"`."""
    for mark, parser in ((KIMI_OPEN, KIMI_K2), (DS_OPEN, DEEPSEEK), (GEMMA_OPEN, GEMMA4),
                         (MISTRAL_CALLS, MISTRAL), ("<arg_key>", GLM45),
                         ("<function=", QWEN3_CODER), (CALL_OPEN, HERMES)):
        if mark in template:
            return parser
    return LLAMA3_JSON if PYTHON_TAG in template or '"parameters"' in template else HERMES
