"""ForgeRL's worker for a verifiers (v1) environment; runs under .venv-verifiers' Python
(scripts/setup_verifiers.sh) because verifiers pins mcp and openai versions ForgeRL's venv does not
have. Standard library plus verifiers only: it never imports forgerl.

    python verifiers_worker.py TASKSET_ID PARAMS_JSON

loads the taskset with verifiers' own loader (`vf.utils.loaders.taskset_class`, the id being an
installed package, `owner/name`, or a folder holding the package), then answers JSON lines on
stdin, one JSON line each on stdout, concurrently (`id` pairs them):

    {"id", "op": "tasks", "split", "size", "seed"}  -> {"id", "result": [task, ...]}
    {"id", "op": "open", "task"}                    -> {"id", "result": {"episode", "prompt",
                                                                         "tools"}}
    {"id", "op": "call", "episode", "name", "arguments"} -> {"id", "result": {"content"}}
    {"id", "op": "score", "episode", "messages"}    -> {"id", "result": {"reward", "rewards",
                                                                         "metrics"}}
    {"id", "op": "close", "episode"}                -> {"id", "result": null}

A failure answers {"id", "error": "one line"}; a tool's own failure or bad arguments is a
result whose content starts with "error:" (MCP's isError result, what the model sees). The first
line out is {"ready": true} or {"fatal": "one line"} (the taskset did not load).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import sys
from pathlib import Path
from typing import Any


def load_taskset(env: str, params: dict[str, Any]):
    """The taskset `env` with config `params` (its TasksetConfig fields; "select" and
    "eval_select" are taken out first: verifiers SelectConfig dicts)."""
    from verifiers.v1.utils import loaders

    path = Path(env)
    if path.is_dir():  # a local package folder, or a project folder holding one
        inner = path / path.name.replace("-", "_")
        sys.path.insert(0, str(path if (inner / "__init__.py").exists() else path.parent))
        env = path.name
    env_cls = loaders.environment_class(env)
    if env_cls.__name__ != "SingleAgentEnv":
        raise ValueError(f"{env!r} exports the multi-agent Env {env_cls.__name__}: not "
                         "supported (ForgeRL plays one agent's tool episodes)")
    config_cls = loaders.taskset_config_type(env)
    return loaders.taskset_class(env)(config_cls.model_validate({**params, "id": env}))


class Worker:
    def __init__(self, env: str, params: dict[str, Any]) -> None:
        import verifiers.v1 as vf

        self.vf = vf
        self.select = {k: params.pop(k, None) for k in ("select", "eval_select")}
        self.taskset = load_taskset(env, params)
        self.episodes: dict[int, dict[str, Any]] = {}
        self.ids = itertools.count()

    def tasks(self, split: str, size: int, seed: int) -> list[dict[str, Any]]:
        """The split's tasks: `select` / `eval_select`, else every 10th task (idx 0, 10, ...)
        is held out; shuffled by `seed` when the taskset is finite; at most `size`."""
        vf = self.vf
        chosen = self.select["eval_select" if split == "eval" else "select"]
        view = self.taskset
        if chosen is not None:
            view = view.select(vf.SelectConfig.model_validate(chosen))
        elif split == "eval":
            view = view.include(idx=["::10"])
        else:
            view = view.exclude(idx=["::10"])
        if view.bounded:
            view = view.shuffle(seed)
        return [{"question": t.data.prompt_text, "vf_type": type(t).__name__,
                 "vf_data": t.data.model_dump(mode="json", exclude_defaults=True)}
                for t in view.take(size)]

    async def open(self, task: dict[str, Any]) -> dict[str, Any]:
        """A new episode: the task rebuilt from its data, its toolsets (per task, then the
        taskset's shared ones) set up in this process, their tools as OpenAI function tools."""
        from mcp.server.mcpserver import MCPServer
        from verifiers.v1.mcp.server import _call_state
        from verifiers.v1.state import state_cls

        cls = self.taskset.task_type()
        vtask = cls(cls.data_type().model_validate(task["vf_data"]), self.taskset.config.task)
        state = state_cls(cls)()
        toolsets = [*cls.toolsets(vtask.config), *type(self.taskset).toolsets(self.taskset.config)]
        tools, dispatch = [], {}
        for toolset in toolsets:
            await toolset.setup()
            await toolset.setup_task(vtask)
            own = state if state_cls(type(toolset)) is type(state) else state_cls(type(toolset))()
            server = MCPServer(toolset.server_name or type(toolset).__name__)
            for fn in self.vf.utils.decorators.discover_decorated(toolset, "tool"):
                server.add_tool(_with(fn, own, _call_state),
                                name=getattr(fn, "tool_name", None) or fn.__name__,
                                description=(fn.__doc__ or "").strip() or None)
            for tool in await server.list_tools():
                full = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
                dispatch[full] = (server, tool.name)
                tools.append({"type": "function", "function": {
                    "name": full, "description": tool.description or "",
                    "parameters": tool.input_schema}})
        episode = next(self.ids)
        self.episodes[episode] = {"task": vtask, "state": state, "dispatch": dispatch,
                                  "toolsets": toolsets}
        prompt = vtask.data.prompt
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                    else [m.model_dump(exclude_none=True) for m in prompt or []])
        if vtask.data.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": vtask.data.system_prompt})
        return {"episode": episode, "prompt": messages, "tools": tools}

    async def call(self, episode: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        dispatch = self.episodes[episode]["dispatch"]
        if name not in dispatch:
            return {"content": f"error: this environment has no tool {name!r}"}
        server, raw = dispatch[name]
        try:
            result = await server.call_tool(raw, arguments)
        except Exception as e:  # MCP's ToolError: bad arguments or the tool raised
            return {"content": f"error: {e}"}
        return {"content": _text(result)}

    async def score(self, episode: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Run the task's rubric (its @vf.reward / @vf.metric functions and judges, no runtime)
        on a trace of the conversation: the weighted reward and each signal."""
        from pydantic import TypeAdapter

        vf = self.vf
        live = self.episodes[episode]
        vtask = live["task"]
        n_prompt = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"),
                        len(messages))
        trace = vf.Trace(task=vf.TraceTask(type=type(vtask).__name__, data=vtask.data,
                                           key=vtask.key, hash=vtask.hash),
                         agent=vf.AgentInfo(config=vf.AgentConfig()), state=live["state"])
        adapter = TypeAdapter(vf.Message)
        for i, m in enumerate(messages):
            trace.nodes.append(vf.MessageNode(
                parent=i - 1 if i else None, message=adapter.validate_python(_vf_message(m)),
                sampled=i >= n_prompt and m.get("role") == "assistant"))
        trace.is_completed = trace.ok = True
        await vtask.score(trace)
        return {"reward": trace.reward,
                "rewards": {k: None if r is None else r.value for k, r in trace.rewards.items()},
                "metrics": trace.metrics}

    async def close(self, episode: int) -> None:
        """Forget the episode; release what its toolsets' setup entered (their exit stacks)."""
        for toolset in self.episodes.pop(episode, {}).get("toolsets", []):
            await toolset._exit_stack.aclose()


def _with(fn, state, var):
    """`fn` run with the episode's state as the toolset's `self.state` (verifiers' context
    variable; its own server syncs it over HTTP, here it lives in this process)."""
    async def wrapper(*args, **kwargs):
        token = var.set(state)
        try:
            result = fn(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result
        finally:
            var.reset(token)

    wrapper.__signature__ = inspect.signature(fn)
    wrapper.__name__ = fn.__name__
    return wrapper


def _text(result: Any) -> str:
    """An MCP CallToolResult as the tool message's text ("error: ..." when it is an error)."""
    text = "\n".join(getattr(b, "text", None) or str(b) for b in result.content)
    return f"error: {text}" if getattr(result, "is_error", False) else text


def _vf_message(m: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as verifiers' Message (tool calls flattened)."""
    out = {k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "name",
                                                "reasoning_content")}
    if m.get("role") in ("system", "user", "tool"):
        out["content"] = out.get("content") or ""
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id", ""), "name": c["function"]["name"],
                              "arguments": c["function"].get("arguments") or "{}"}
                             for c in m["tool_calls"]]
    return out


async def serve(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    pending: set[asyncio.Task] = set()

    async def answer(request: dict[str, Any]) -> None:
        out: dict[str, Any] = {"id": request.get("id")}
        try:
            op = request.pop("op")
            args = {k: v for k, v in request.items() if k != "id"}
            result = getattr(worker, op)(**args)
            out["result"] = await result if inspect.isawaitable(result) else result
        except Exception as e:
            out["error"] = _line(e)
        PROTOCOL.write(json.dumps(out) + "\n")
        PROTOCOL.flush()

    while line := await reader.readline():
        task = asyncio.create_task(answer(json.loads(line)))
        pending.add(task)
        task.add_done_callback(pending.discard)
    with contextlib.suppress(Exception):
        await asyncio.gather(*pending)


def _line(e: Exception) -> str:
    """`e` in one line: its first three lines joined (a pydantic ValidationError's first
    names the config class, the next two the field and what is wrong with it)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()][:3]
    return f"{type(e).__name__}: {'; '.join(lines)}"[:500]


PROTOCOL = sys.stdout
"""The JSON-lines channel; whatever else prints goes to stderr (sys.stdout is swapped)."""


def main() -> None:
    sys.stdout = sys.stderr
    try:
        worker = Worker(sys.argv[1], json.loads(sys.argv[2]))
    except Exception as e:
        print(json.dumps({"fatal": _line(e)}), file=PROTOCOL, flush=True)
        sys.exit(1)
    print(json.dumps({"ready": True}), file=PROTOCOL, flush=True)
    asyncio.run(serve(worker))


if __name__ == "__main__":
    main()
