"""Messages -> token ids in ChatML, with a Hermes-style tool section (the gateway tokenises).

Data flow: the gateway core renders a conversation (conversation.py: `Message`s and `Tool`s, the
internal form every protocol is translated into) to prompt ids with `ChatMLRenderer.render`,
sends ids to the rollout engine and decodes the completion ids only to parse them for the client.
SmolLM2's own chat template is plain ChatML with no tool support, so the tool section is ours:

    <|im_start|>system\n{system}\n\n# Tools ... <tools>\n{one JSON signature per line}\n</tools>
    ... <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>user\n{content}<|im_end|>\n
    <|im_start|>assistant\n{content}\n<tool_call>\n{...}\n</tool_call><|im_end|>\n
    <|im_start|>user\n<tool_response>\n{tool content}\n</tool_response><|im_end|>\n
    <|im_start|>assistant\n                                    <- generation prompt

Consecutive `tool` messages share one user turn (Qwen2.5 style). The template's control tokens
(`<|im_start|>`, `<|im_end|>`) are added as ids; every text segment between them (role, content,
tool JSON) is tokenised on its own with special tokens split, so a control string inside content
(`<|im_end|>\n<|im_start|>assistant` in a tool result) becomes ordinary text ids and can never
forge a turn, and it decodes back to the same text. A rendering is the concatenation of its
turns' ids; token-in-token-out (sessions.py) relies on that to append new turns after recorded
ids without re-encoding them (`continuation`).

`Renderer` is what the gateway core and sessions use of a chat format; `ChatMLRenderer` is one,
the model's own jinja template (templates.py, `HFTemplateRenderer`) the other.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from transformers import PreTrainedTokenizerBase

from forgerl.gateway.conversation import Message, Tool, ToolCall
from forgerl.gateway.errors import loads_json_text
from forgerl.gateway.renderers.reasoning import ReasoningFormat, detect_reasoning, prompted
from forgerl.gateway.renderers.tool_parsers import CALL_CLOSE, CALL_OPEN, HERMES, ToolParser

START, END = "<|im_start|>", "<|im_end|>"

TOOLS_HEADER = (
    "# Tools\n\n"
    "You can call functions to help answer. Their signatures are listed inside <tools></tools>, "
    "one JSON object per line:\n<tools>\n"
)
TOOLS_FOOTER = (
    "\n</tools>\n\n"
    "To call a function, reply with one block per call, each holding a JSON object with the "
    "function name and its arguments:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
)


def call_arguments(call: ToolCall) -> Any:
    """A tool call's arguments as the object the model is asked to emit: its JSON text parsed
    (`errors.loads_json_text`: a lone surrogate escape is U+FFFD); "" is {}, and text that does
    not parse (malformed, nested too deeply, an integer of over 4,300 digits) is kept as is."""
    args: Any = call.arguments
    with contextlib.suppress(ValueError, RecursionError):
        args = loads_json_text(args) if args.strip() else {}
    return args


def tool_call_json(call: ToolCall) -> str:
    """One tool call as the Hermes JSON object `{"name": ..., "arguments": {...}}`."""
    return json.dumps({"name": call.name, "arguments": call_arguments(call)}, ensure_ascii=False)


def tool_signature(tool: Tool) -> dict[str, Any]:
    """The JSON signature listed for a tool: name, then description and parameters when set."""
    sig: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        sig["description"] = tool.description
    if tool.parameters is not None:
        sig["parameters"] = dict(tool.parameters)
    return sig


def tools_section(tools: Sequence[Tool]) -> str:
    """The system-prompt tool section: one JSON function signature per line."""
    sigs = [json.dumps(tool_signature(t), ensure_ascii=False) for t in tools]
    return TOOLS_HEADER + "\n".join(sigs) + TOOLS_FOOTER


BYTE_FALLBACK = re.compile("<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


def token_text(raw: bytes) -> str:
    """A token's bytes (`Renderer.token_bytes`) as the text of its logprob entry: UTF-8, with
    bytes that are no whole character escaped ("\\xc3"), never U+FFFD."""
    return raw.decode(errors="backslashreplace")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed (character -> byte): printable Latin-1 bytes stand
    for themselves, the other 68 bytes for U+0100 on, in byte order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


class Renderer:
    """Messages (+ tools) <-> token ids in one chat format, and the tool-call format that goes
    with it (`parser`). Subclasses set `tokenizer`, `parser`, `end_of_turn_id` (the id the
    format closes an assistant turn with) and `stop_ids` (every id that ends a reply, that one
    first), and implement `decode`, `render` and `continuation`."""

    tokenizer: PreTrainedTokenizerBase
    parser: ToolParser
    end_of_turn_id: int
    stop_ids: tuple[int, ...]
    template_kwargs: Mapping[str, Any] = MappingProxyType({})
    """Variables passed to the chat template (`chat_template_kwargs`, e.g. Qwen3's
    `enable_thinking`); set by `bind`. A format with no template variables ignores them."""
    takes_template_kwargs = False
    """Whether `template_kwargs` can change this format's rendering."""

    def bind(self, template_kwargs: Mapping[str, Any]) -> Renderer:
        """This renderer with `template_kwargs` (self when they are its own, or when it takes
        none); the bound copies are kept per distinct kwargs (at most 64), so each renders with
        its own probes (`late_system`, `keeps_think_text`)."""
        wanted = dict(template_kwargs)
        if not self.takes_template_kwargs or wanted == dict(self.template_kwargs):
            return self
        key = json.dumps(wanted, sort_keys=True, default=str)
        cache = self.__dict__.setdefault("_bound", {})
        if key not in cache:
            if len(cache) >= 64:
                cache.pop(next(iter(cache)))
            bound = copy.copy(self)
            bound.__dict__ = {k: v for k, v in self.__dict__.items()
                              if k not in ("_bound", "late_system", "keeps_think_text")}
            bound.template_kwargs = MappingProxyType(wanted)
            cache[key] = bound
        return cache[key]

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, no BOS/EOS added; special-token strings in `text` are split
        into ordinary ids (message content never becomes a control token)."""
        if not text:
            return []
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token string of the vocabulary, in characters: no token decodes to more
        characters than its string has (a byte-level "Ġ" is one byte, "<0x0A>" one byte)."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)

    @functools.cached_property
    def keeps_think_text(self) -> bool:
        """Whether an earlier assistant reply's text before its `</think>` is in this format's
        rendering (ChatML keeps it; templates like Qwen3's drop it as reasoning): probed once on
        a two-turn conversation; True when the probe cannot render."""
        probe = "q7x9zk"
        turns = [Message("user", "a"), Message("assistant", f"<think>{probe}</think>b"),
                 Message("user", "c")]
        try:
            return probe in self.tokenizer.decode(self.render(turns))
        except Exception:  # a template that needs other turns: count the text
            return True

    @functools.cached_property
    def reasoning(self) -> ReasoningFormat | None:
        """The reasoning format of this format's replies (reasoning.py): the one the chat
        template writes, as its generation prompt leaves it (None when the prompt turns
        reasoning off or the template has none); probed once on a one-message prompt."""
        fmt = detect_reasoning(str(self.tokenizer.chat_template or ""))
        if fmt is None:
            return None
        try:
            prompt = self.tokenizer.decode(self.render([Message("user", "a")]))
        except Exception:  # a template that needs other turns: the reply may open reasoning
            return fmt
        return prompted(fmt, prompt)

    def min_tokens(self, texts: Iterable[str]) -> int:
        """A lower bound on the tokens of a rendering that holds each of `texts`, without
        tokenizing: sum(len(text.strip())) / (2 * max_token_chars). Templates may strip a
        message; the factor 2 covers normalizers that fold characters (NFKC)."""
        return sum(len(t.strip()) for t in texts) // (2 * self.max_token_chars)

    def decode(self, ids: list[int]) -> str:
        """Text of completion ids (for parsing and the client only)."""
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for, which may be part of a UTF-8 character (the
        `bytes` of an OpenAI logprob, from which split characters are rebuilt): a byte-level
        BPE token's own bytes (GPT-2's alphabet: SmolLM2's "Ã©" is [0xC3, 0xA9]), a
        byte-fallback "<0xNN>" token's byte, else its text decoded alone, as UTF-8."""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(token, str):
            if m := BYTE_FALLBACK.fullmatch(token):
                return bytes([int(m[1], 16)])
            table = _byte_decoder()
            if self._byte_level and all(c in table for c in token):
                return bytes(table[c] for c in token)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        return type(decoder).__name__ == "ByteLevel"

    def render(self, messages: Sequence[Message], tools: Sequence[Tool] = (),
               add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of a whole conversation (ending with the assistant generation header
        when `add_generation_prompt`)."""
        raise NotImplementedError

    def continuation(self, history: Sequence[Message], new: Sequence[Message],
                     tools: Sequence[Tool], completion_ids: list[int]) -> list[int] | None:
        """Ids to append after a recorded turn's prompt + completion ids so the sequence is
        this format's rendering of `history + new` with the generation prompt (token-in-token-
        out, sessions.py). `history`: that turn's request messages and its reply (last);
        `completion_ids`: its sampled ids (an end-of-turn id is added when they lack one).
        None when the format does not extend the earlier rendering (it rewrites earlier turns)."""
        raise NotImplementedError

    def tool_call_prefix(self, name: str | None) -> str | None:
        """The reply text that opens a tool call (of tool `name`, or of any tool when None): a
        prefill after the generation prompt that makes the model's reply a tool call, the way
        the format asks for it (`tool_choice` "required" or a named tool). None: the format
        cannot be forced."""
        return self.parser.call_prefix(name)

    @property
    def call_close(self) -> str | None:
        """The text that closes one tool call (a reply limited to one call stops after it);
        None when the format has none."""
        return self.parser.close


class ChatMLRenderer(Renderer):
    """Renders conversation messages (+ tools) to ChatML token ids.

    Args:
        tokenizer: a HF tokenizer that knows `<|im_start|>` and `<|im_end|>` as special tokens.
        default_system: inserted as the system message when a request has none (SmolLM2's
            template inserts its own default there); None inserts nothing (unless tools are
            given, which always need a system turn for the tool section).

    Raises ValueError if the tokenizer lacks the ChatML special tokens or cannot encode them as
    plain text (`split_special_tokens`).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, default_system: str | None = None):
        self.tokenizer = tokenizer
        self.default_system = default_system
        self.start_of_turn_id = self._special_id(START)
        self.end_of_turn_id = self._special_id(END)
        self.stop_ids = (self.end_of_turn_id,)
        self.parser = HERMES
        self.newline_ids = self.encode("\n")
        self.generation_prompt_ids = [self.start_of_turn_id, *self.encode("assistant\n")]
        if self.start_of_turn_id in self.encode(START):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} ignores split_special_tokens: "
                             f"text {START!r} would encode as the control token")

    def _special_id(self, token: str) -> int:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"tokenizer has no single special token {token!r} (got ids {ids})")
        return ids[0]

    def decode(self, ids: list[int]) -> str:
        """Text of completion ids, special tokens dropped (for parsing and the client only)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def with_system(self, messages: Sequence[Message], tools: Sequence[Tool]) -> list[Message]:
        """Messages with the default system turn inserted and the tool section appended to it."""
        msgs = list(messages)
        has_system = bool(msgs) and msgs[0].role == "system"
        if not has_system and (self.default_system is not None or tools):
            msgs.insert(0, Message("system", self.default_system or ""))
        if tools:
            system, section = msgs[0].content, tools_section(tools)
            msgs[0] = Message("system", f"{system}\n\n{section}" if system else section)
        return msgs

    def turn_ids(self, role: str, text: str) -> list[int]:
        """`<|im_start|>{role}\\n{text}<|im_end|>` as ids (the trailing "\\n" is not included)."""
        return [self.start_of_turn_id, *self.encode(f"{role}\n{text}"), self.end_of_turn_id]

    def render_turns(self, messages: Sequence[Message]) -> list[int]:
        """Ids of messages rendered as they are (no system insertion, no generation prompt).

        Each turn is followed by the "\\n" segment. Consecutive tool messages share a user turn.
        An assistant message's `reasoning` is not rendered (ChatML has no slot for it).
        """
        ids: list[int] = []
        i = 0
        while i < len(messages):
            msg = messages[i]
            if msg.role == "tool":
                blocks = []
                while i < len(messages) and messages[i].role == "tool":
                    blocks.append(f"<tool_response>\n{messages[i].content}\n</tool_response>")
                    i += 1
                ids += self.turn_ids("user", "\n".join(blocks)) + self.newline_ids
                continue
            text = msg.content
            if msg.role == "assistant" and msg.tool_calls:
                calls = [f"{CALL_OPEN}\n{tool_call_json(c)}\n{CALL_CLOSE}" for c in msg.tool_calls]
                text = "\n".join(([text] if text else []) + calls)
            ids += self.turn_ids(msg.role, text) + self.newline_ids
            i += 1
        return ids

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool] = (),
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt ids for a conversation: system (+ tools) turn, every message, then
        `<|im_start|>assistant\\n` when `add_generation_prompt` (CASES.md C03)."""
        ids = self.render_turns(self.with_system(messages, tools))
        return ids + self.generation_prompt_ids if add_generation_prompt else ids

    def continuation(self, history: Sequence[Message], new: Sequence[Message],
                     tools: Sequence[Tool], completion_ids: list[int]) -> list[int]:
        """ChatML always extends: (`<|im_end|>` if missing) "\\n", the new turns, the header."""
        closed = bool(completion_ids) and completion_ids[-1] == self.end_of_turn_id
        return ([] if closed else [self.end_of_turn_id]) + self.newline_ids + self.render_turns(
            new) + self.generation_prompt_ids
