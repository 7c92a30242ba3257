"""OpenEnv worker for ForgeRL's `openenv` task source (forgerl/tasks/openenv.py).

Runs under the venv that has OpenEnv (`openenv`, scripts/setup_openenv.sh) and plays episodes
with OpenEnv's own async client, `openenv.core.GenericEnvClient` (the WebSocket session of
`reset` / `step` / `state`, simulation mode: each step returns a reward and `done`). It speaks
JSON lines on stdin/stdout, one request `{"id", "op", ...}` to one reply `{"id", ...}`; requests
run concurrently. Imports nothing of ForgeRL.

    open  {url, reset, tools}   -> {episode, observation, tools, mcp}  (reset(**reset); the MCP
          tools from a list_tools step, or the /schema action when tools is "action" or, with
          "auto", when the environment refuses list_tools)
    step  {episode, action}     -> {observation, reward, done}
    close {episode}             -> {}
    An error reply is {"error": text, "policy": bool}: policy is true when the environment
    rejected the action as invalid (the policy's mistake), false for everything else.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from openenv.core import GenericEnvClient

OUT = os.fdopen(os.dup(1), "w", buffering=1)
sys.stdout = sys.stderr  # the environment's prints must not corrupt the protocol
EPISODES: dict[int, GenericEnvClient] = {}


async def _open(req: dict) -> dict:
    client = GenericEnvClient(base_url=req["url"], message_timeout_s=req.get("timeout", 60.0))
    try:
        result = await client.reset(**req.get("reset", {}))
        tools, mcp, mode = None, False, req.get("tools", "auto")
        if mode != "action":
            try:
                listed = await client.step({"type": "list_tools"})
                tools = listed.observation.get("tools")
                mcp = tools is not None
            except RuntimeError:
                if mode == "mcp":
                    raise
        if tools is None:
            import httpx  # lazy: only action environments need the schema

            async with httpx.AsyncClient() as http:
                schema = (await http.get(req["url"].rstrip("/") + "/schema")).json()
            tools = [{"name": req.get("action_tool", "step"), "input_schema": schema["action"],
                      "description": schema["action"].get("description", "")}]
    except BaseException:
        await client.close()
        raise
    EPISODES[id(client)] = client
    return {"episode": id(client), "observation": result.observation, "tools": tools,
            "mcp": mcp}


async def _handle(req: dict) -> dict:
    op = req["op"]
    if op == "open":
        return await _open(req)
    client = EPISODES[req["episode"]]
    if op == "close":
        EPISODES.pop(req["episode"], None)
        await client.close()
        return {}
    result = await client.step(req["action"])
    return {"observation": result.observation, "reward": result.reward, "done": result.done}


async def _serve(req: dict) -> None:
    try:
        reply = await _handle(req)
    except Exception as e:  # every failure is answered; the adapter decides whose it is
        text = f"{type(e).__name__}: {e}"
        reply = {"error": text, "policy": "VALIDATION_ERROR" in text}
    OUT.write(json.dumps({"id": req["id"], **reply}, default=str) + "\n")


async def main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks = set()
    while line := await reader.readline():
        task = asyncio.create_task(_serve(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for client in list(EPISODES.values()):
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
