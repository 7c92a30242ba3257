"""Messages -> token ids in ChatML, with a Hermes-style tool section (the gateway tokenises).

Data flow: the gateway renders an OpenAI chat request to prompt ids with `ChatMLRenderer.render`,
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
ids without re-encoding them.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]

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


def content_text(content: Any) -> str:
    """The text of an OpenAI message content: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content if isinstance(p, dict))


def tool_call_json(call: dict[str, Any]) -> str:
    """One OpenAI tool call as the Hermes JSON object `{"name": ..., "arguments": {...}}`.

    `function.arguments` is a JSON string in the OpenAI API; it is parsed back to an object so
    the rendering matches what the model is asked to emit (an unparsable string is kept as is).
    """
    fn = call.get("function") or {}
    args: Any = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args) if args.strip() else {}
    return json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The system-prompt tool section: one JSON function signature per line."""
    sigs = [json.dumps(t.get("function", t), ensure_ascii=False) for t in tools]
    return TOOLS_HEADER + "\n".join(sigs) + TOOLS_FOOTER


class ChatMLRenderer:
    """Renders OpenAI chat messages (+ tools) to ChatML token ids.

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

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, no BOS/EOS added; special-token strings in `text` are split
        into ordinary ids (message content never becomes a control token)."""
        if not text:
            return []
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        """Text of completion ids, special tokens dropped (for parsing and the client only)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def with_system(
        self, messages: list[Message], tools: list[dict[str, Any]] | None
    ) -> list[Message]:
        """Messages with the default system turn inserted and the tool section appended to it."""
        msgs = list(messages)
        has_system = bool(msgs) and msgs[0].get("role") in ("system", "developer")
        if not has_system and (self.default_system is not None or tools):
            msgs.insert(0, {"role": "system", "content": self.default_system or ""})
        if tools:
            system = content_text(msgs[0].get("content"))
            section = tools_section(tools)
            msgs[0] = {"role": "system", "content": f"{system}\n\n{section}" if system else section}
        return msgs

    def turn_ids(self, role: str, text: str) -> list[int]:
        """`<|im_start|>{role}\\n{text}<|im_end|>` as ids (the trailing "\\n" is not included)."""
        return [self.start_of_turn_id, *self.encode(f"{role}\n{text}"), self.end_of_turn_id]

    def render_turns(self, messages: list[Message]) -> list[int]:
        """Ids of messages rendered as they are (no system insertion, no generation prompt).

        Each turn is followed by the "\\n" segment. Consecutive tool messages share a user turn.
        """
        ids: list[int] = []
        i = 0
        while i < len(messages):
            msg = messages[i]
            role = msg.get("role", "user")
            if role == "tool":
                blocks = []
                while i < len(messages) and messages[i].get("role") == "tool":
                    text = content_text(messages[i].get("content"))
                    blocks.append(f"<tool_response>\n{text}\n</tool_response>")
                    i += 1
                ids += self.turn_ids("user", "\n".join(blocks)) + self.newline_ids
                continue
            text = content_text(msg.get("content"))
            if role == "assistant" and msg.get("tool_calls"):
                calls = [
                    f"<tool_call>\n{tool_call_json(c)}\n</tool_call>" for c in msg["tool_calls"]
                ]
                text = "\n".join(([text] if text else []) + calls)
            role = "system" if role == "developer" else role
            ids += self.turn_ids(role, text) + self.newline_ids
            i += 1
        return ids

    def render(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Prompt ids for a chat request: system (+ tools) turn, every message, then
        `<|im_start|>assistant\\n` when `add_generation_prompt` (CASES.md C03)."""
        ids = self.render_turns(self.with_system(messages, tools))
        return ids + self.generation_prompt_ids if add_generation_prompt else ids
