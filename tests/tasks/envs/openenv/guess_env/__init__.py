"""guess_env: a small OpenEnv environment written to the standard with its own package
(`openenv`), for ForgeRL's openenv adapter tests. Served by `uvicorn guess_env.server:app`
(an MCP environment: one tool, `guess`) and `uvicorn guess_env.server:echo_app` (an action
environment: no tools, an `EchoAction` per step)."""
