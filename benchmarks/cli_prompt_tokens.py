"""How many SmolLM2 tokens each coding CLI's first model call takes (vs its 8,192 positions).

    python benchmarks/cli_prompt_tokens.py [--captures DIR] [--keep DIR]

Each CLI in harnesses/ (Claude Code, Codex CLI, OpenCode, Pi; pinned versions, unmodified) runs
one task ("Create a file named fruit.txt containing the word banana.") in an empty temporary
directory (also its PWD: OpenCode reads the project directory from it), pointed with only a
base URL, a key and a model name ("policy") at a local capture server that saves every request
body and answers it with a 400, so the CLI stops after its first calls and nothing depends on
the gateway's request policy. `--captures DIR` reads bodies saved earlier instead (files
`<cli>/NN.json`: a JSON line {"path", "headers"}, then the body).

The CLI's main call (the largest body with tools; OpenCode's title call, sent first, has none)
is translated to chat messages and tools and rendered with SmolLM2's chat format exactly as the
gateway renders a chat request (ChatML with the Hermes tool section), plus the generation
prompt. The translation: Anthropic `system` blocks and Responses `developer` items become
system messages and text blocks are joined ("" between blocks, as the gateway's chat protocol
joins text parts); server and namespace tools (no JSON-schema function) are left out and
counted. Claude Code is also counted with its tools cut to Pi's four (`--tools`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "harnesses" / "node_modules" / ".bin"
TASK = "Create a file named fruit.txt containing the word banana."
QUIET = {"DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
         "DISABLE_AUTOUPDATER": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
         "OPENCODE_DISABLE_MODELS_FETCH": "1", "PI_OFFLINE": "1", "PI_TELEMETRY": "0"}


class Capture(ThreadingHTTPServer):
    """Saves each POST as `out/NN.json` and answers 400 (no client retries a 400)."""

    def __init__(self, out: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.out, self.count, self.lock = out, 0, threading.Lock()
        out.mkdir(parents=True, exist_ok=True)


class _Handler(BaseHTTPRequestHandler):
    server: Capture

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        with self.server.lock:
            self.server.count += 1
            name = self.server.out / f"{self.server.count:02d}.json"
        head = json.dumps({"path": self.path, "headers": dict(self.headers)})
        name.write_bytes(head.encode() + b"\n" + body)
        data = json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                      "message": "captured"}}).encode()
        self.send_response(400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def commands(cli: str, url: str, home: Path) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that point `cli` at `url` with a key and model "policy"."""
    if cli.startswith("claude"):
        tools = ["--tools", "Bash,Read,Edit,Write"] if cli == "claude-4-tools" else []
        return ([str(BIN / "claude"), "-p", TASK, "--model", "policy", *tools],
                {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-capture"})
    if cli == "codex":
        (home / "codex").mkdir()
        provider = (f'model_providers.forgerl={{name="forgerl", base_url="{url}/v1", '
                    'env_key="OPENAI_API_KEY", wire_api="responses"}')
        return ([str(BIN / "codex"), "exec", "--skip-git-repo-check", "-m", "policy", "-c",
                 "model_provider=forgerl", "-c", provider, TASK],
                {"CODEX_HOME": str(home / "codex"), "OPENAI_API_KEY": "sk-capture"})
    if cli == "opencode":
        (home / "work" / "opencode.json").write_text(json.dumps({"provider": {"forgerl": {
            "npm": "@ai-sdk/openai-compatible", "name": "ForgeRL",
            "options": {"baseURL": f"{url}/v1", "apiKey": "sk-capture"},
            "models": {"policy": {"name": "policy", "limit": {"context": 8192, "output": 256}}}}},
            "model": "forgerl/policy", "autoupdate": False, "share": "disabled"}))
        return [str(BIN / "opencode"), "run", "-m", "forgerl/policy", TASK], {}
    (home / "pi").mkdir(exist_ok=True)
    (home / "pi" / "models.json").write_text(json.dumps({"providers": {"forgerl": {
        "baseUrl": f"{url}/v1", "api": "openai-completions", "apiKey": "sk-capture",
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": "policy", "contextWindow": 8192, "maxTokens": 256}]}}}))
    return ([str(BIN / "pi"), "--provider", "forgerl", "--model", "policy", "--no-session",
             "-p", TASK], {"PI_CODING_AGENT_DIR": str(home / "pi")})


def capture(cli: str, out: Path) -> None:
    """Run `cli` once against a capture server writing to `out` (at most 120 s)."""
    server = Capture(out)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        (home / "work").mkdir()
        argv, extra = commands(cli, f"http://127.0.0.1:{server.server_address[1]}", home)
        env = {**os.environ, **QUIET, "HOME": str(home), "PWD": str(home / "work"),
               "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".data"),
               "XDG_CACHE_HOME": str(home / ".cache"), **extra}
        subprocess.run(argv, cwd=home / "work", env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=120)
    server.shutdown()


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict))


def _tool(t: dict) -> dict | None:
    """A chat function tool from an Anthropic / Responses / chat declaration; None for a server
    or namespace tool."""
    if t.get("type") == "function" and "function" in t:
        return t
    schema = t.get("input_schema") if "input_schema" in t else t.get("parameters")
    if schema is None or t.get("type") not in (None, "function", "custom"):
        return None
    return {"type": "function", "function": {"name": t["name"], "parameters": schema,
                                             "description": t.get("description", "")}}


def to_chat(path: str, body: dict) -> tuple[str, list[dict], list[dict], list[str]]:
    """(API, chat messages, chat tools, tools left out) of one captured request."""
    if "/messages" in path:
        api = "Anthropic Messages"
        messages = [{"role": "system", "content": _text(body["system"])}] if body.get(
            "system") else []
        messages += [{"role": m["role"], "content": _text(m["content"])}
                     for m in body["messages"]]
    elif "/responses" in path:
        api = "Responses"
        messages = [{"role": "system", "content": body["instructions"]}] if body.get(
            "instructions") else []
        messages += [{"role": "system" if m["role"] == "developer" else m["role"],
                      "content": _text(m["content"])}
                     for m in body["input"] if m.get("type", "message") == "message"]
    else:
        api = "Chat Completions"
        messages = [{"role": m["role"], "content": _text(m["content"])}
                    for m in body["messages"]]
    tools, left = [], []
    for t in body.get("tools") or []:
        chat = _tool(t)
        (tools.append(chat) if chat else left.append(t.get("name") or t.get("type")))
    return api, messages, tools, left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--captures", type=Path, default=None, help="bodies saved earlier")
    parser.add_argument("--keep", type=Path, default=None, help="save the captures here")
    parser.add_argument("--clis", default="claude,claude-4-tools,codex,opencode,pi")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from forgerl.gateway.protocols import chat
    from forgerl.gateway.renderers.templates import build_renderer
    from forgerl.models import smollm2_dir

    renderer = build_renderer(AutoTokenizer.from_pretrained(smollm2_dir()))
    with tempfile.TemporaryDirectory() as tmp:
        root = args.captures or args.keep or Path(tmp)
        print(f"{'CLI':<16}{'API':<20}{'calls':>6}{'tools':>6}  {'left out':<28}{'tokens':>8}"
              f"{'left of 8,192':>15}")
        for cli in args.clis.split(","):
            if args.captures is None:
                capture(cli, root / cli)
            files = sorted((root / cli).glob("*.json"))
            bodies = [(json.loads(h)["path"], json.loads(b)) for h, b in
                      (f.read_text().split("\n", 1) for f in files)]
            path, body = max((pb for pb in bodies if pb[1].get("tools")),
                             key=lambda pb: len(json.dumps(pb[1])))
            api, messages, tools, left = to_chat(path, body)
            n = len(renderer.render(chat.messages(messages), chat.tools(tools),
                                    add_generation_prompt=True))
            print(f"{cli:<16}{api:<20}{len(bodies):>6}{len(tools):>6}  "
                  f"{', '.join(left) or '-':<28}{n:>8}{8192 - n:>15}", flush=True)


if __name__ == "__main__":
    main()
