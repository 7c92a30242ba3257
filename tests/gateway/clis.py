"""The four coding-agent CLIs, unmodified, pointed at a gateway (tests/gateway/test_cli_*.py).

Each CLI is configured only with a base URL, a session key, a model name and its offline /
telemetry switches, in a fresh HOME: exactly what docs/coding-clis.md tells a user. The
binaries are the pinned ones scripts/setup.sh installs (harnesses/package.json); nothing is
downloaded at run time. `WRITE` is each CLI's own file-writing tool call (names and argument keys
as the CLIs declare them in their tool lists) for the task `TASK`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "harnesses" / "node_modules" / ".bin"
TASK = "Create a file hello.txt containing hi"
FILE, CONTENT = "hello.txt", "hi"
MODEL = "tiny"

APIS = {"claude": ("messages",), "codex": ("responses",), "opencode": ("chat",),
        "pi": ("chat", "messages", "responses")}
"""The APIs each CLI speaks (Pi: its three providers)."""


def cases() -> list[tuple[str, str]]:
    """(cli, api) for every API of every CLI."""
    return [(cli, api) for cli, apis in APIS.items() for api in apis]


def write_call(cli: str, workdir: Path) -> tuple[str, dict]:
    """(tool name, arguments) of the CLI's own tool call that writes FILE with CONTENT."""
    path = str(workdir / FILE)
    return {"claude": ("Write", {"file_path": path, "content": CONTENT}),
            "codex": ("exec_command", {"cmd": f"printf {CONTENT} > {FILE}"}),
            "opencode": ("write", {"filePath": path, "content": CONTENT}),
            "pi": ("write", {"path": FILE, "content": CONTENT})}[cli]


def require(cli: str) -> Path:
    """The pinned CLI's executable; fails (never skips) when the set-up has not installed it."""
    exe = BIN / cli
    if not exe.exists() or shutil.which("node") is None:
        pytest.fail(f"{exe} (and node on PATH) missing: run scripts/setup.sh, which installs the "
                    "pinned coding-agent CLIs with `npm install --prefix harnesses`")
    return exe


@dataclass
class Run:
    """One CLI run: exit code, output, and the working directory the task ran in."""

    returncode: int
    stdout: str
    stderr: str
    workdir: Path


def configure(cli: str, api: str, root_url: str, key: str, home: Path) -> tuple[list[str], dict]:
    """(argv, env) of a non-interactive run of `cli` on `api` against `root_url` (no /v1)."""
    exe = str(require(cli))
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "LANG": "C.UTF-8"}
    v1 = f"{root_url}/v1"
    if cli == "claude":
        env |= {"ANTHROPIC_BASE_URL": root_url, "ANTHROPIC_API_KEY": key,
                "ANTHROPIC_MODEL": MODEL, "DISABLE_TELEMETRY": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
        # --dangerously-skip-permissions is refused as root; acceptEdits lets Write run.
        return [exe, "-p", TASK, "--permission-mode", "acceptEdits"], env
    if cli == "codex":
        (home / ".codex").mkdir()
        (home / ".codex" / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "forgerl"\n\n[model_providers.forgerl]\n'
            f'name = "ForgeRL"\nbase_url = "{v1}"\nenv_key = "FORGERL_API_KEY"\n'
            'wire_api = "responses"\n')
        env |= {"CODEX_HOME": str(home / ".codex"), "FORGERL_API_KEY": key}
        return [exe, "exec", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", TASK], env
    if cli == "opencode":
        config = {"$schema": "https://opencode.ai/config.json", "model": f"forgerl/{MODEL}",
                  "provider": {"forgerl": {
                      "npm": "@ai-sdk/openai-compatible", "name": "ForgeRL",
                      "options": {"baseURL": v1, "apiKey": key},
                      "models": {MODEL: {"name": MODEL}}}}}
        (home / "opencode.json").write_text(json.dumps(config))
        env |= {"OPENCODE_CONFIG": str(home / "opencode.json"),
                "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1",
                "OPENCODE_DISABLE_MODELS_FETCH": "1", "npm_config_offline": "true"}
        return [exe, "run", TASK], env
    provider = {"chat": ("openai-completions", v1), "messages": ("anthropic-messages", root_url),
                "responses": ("openai-responses", v1)}
    (home / "agent").mkdir()
    (home / "agent" / "models.json").write_text(json.dumps({"providers": {
        f"forgerl-{name}": {"baseUrl": url, "api": kind, "apiKey": key, "models": [{"id": MODEL}]}
        for name, (kind, url) in provider.items()}}))
    env |= {"PI_CODING_AGENT_DIR": str(home / "agent"), "PI_OFFLINE": "1"}
    return [exe, "-p", "--provider", f"forgerl-{api}", "--model", MODEL, TASK], env


def run(cli: str, api: str, root_url: str, key: str, tmp: Path, timeout_s: float = 60) -> Run:
    """Run the CLI on TASK in a fresh working directory and HOME under `tmp`; stdin is empty."""
    home, workdir = tmp / f"{cli}-{api}-home", tmp / f"{cli}-{api}-work"
    home.mkdir()
    workdir.mkdir()
    argv, env = configure(cli, api, root_url, key, home)
    p = subprocess.run(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=timeout_s)
    return Run(p.returncode, p.stdout, p.stderr, workdir)
