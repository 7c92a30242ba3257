"""Harbor tasks (`harbor` 0.25.0's task folders; docs/environments/harbor.md has the mapping).

Harbor needs Python >= 3.12 and cannot install beside ForgeRL, so this module reads the format
itself, following harbor.models.task and harbor.verifier.verifier 0.25.0: instruction.md is the
question; environment/Dockerfile is applied to the rollout's Sandbox without Docker (WORKDIR,
ENV, COPY/ADD of the build context, RUN inside; FROM and the rest ignored); after the agent,
tests/ goes to /tests and test.sh's /logs/verifier/reward.json (else reward.txt) is the outcome.
A verifier that times out or leaves no readable reward gives 0 (status "timeout" / "error"); an
environment that does not build or a sandbox that fails is an EnvironmentError.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
import shutil
import tomllib
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any

from forgerl.agents.sandbox import SandboxError
from forgerl.tasks.base import Environment, EnvironmentError, Episode

FIXED = ("/tests", "/logs", "/solution")  # Harbor's EnvironmentPaths
IGNORED = {"FROM", "ARG", "USER", "CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "VOLUME", "SHELL",
           "HEALTHCHECK", "STOPSIGNAL", "ONBUILD", "MAINTAINER"}


@lru_cache(maxsize=256)
def load(folder: str) -> dict[str, Any]:
    """One Harbor task folder: its instruction, task.toml (as a dict), workdir, environment
    variables and build steps [(op, arg)] with op "copy" ((sources, dest)) or "run" (a shell
    command). Raises ValueError naming the file for what cannot be built without Docker."""
    root = Path(folder)
    if not (root / "instruction.md").is_file() or not (root / "task.toml").is_file():
        raise ValueError(f"{root}: not a Harbor task (instruction.md and task.toml needed)")
    try:
        config = tomllib.loads((root / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{root}/task.toml: not valid TOML ({e})") from None
    if config.get("steps"):
        raise ValueError(f"{root}/task.toml: multi-step tasks are not supported")
    if not (root / "tests" / "test.sh").is_file():
        raise ValueError(f"{root}: no tests/test.sh")
    workdir, env, steps = PurePosixPath("/"), {}, []
    dockerfile = root / "environment" / "Dockerfile"
    text = dockerfile.read_text() if dockerfile.is_file() else ""
    for line in re.sub(r"\\\n", " ", text).splitlines():
        op, _, arg = line.strip().partition(" ")
        op, arg = op.upper(), arg.strip()
        if not op or op.startswith("#") or op in IGNORED:
            continue
        if op == "WORKDIR":
            workdir = workdir / arg
        elif op == "ENV":
            pairs = shlex.split(arg)
            env.update(dict(p.split("=", 1) for p in pairs) if "=" in pairs[0]
                       else {pairs[0]: " ".join(pairs[1:])})
        elif op in ("COPY", "ADD"):
            parts = json.loads(arg) if arg.startswith("[") else shlex.split(arg)
            if any(p.startswith("--from") or "://" in p for p in parts):
                raise ValueError(f"{dockerfile}: {op} {arg}: only the build context is copied")
            parts = [p for p in parts if not p.startswith("--")]
            slash = "/" if parts[-1].endswith("/") else ""
            steps.append(("copy", (parts[:-1], str(workdir / parts[-1]) + slash)))
        elif op == "RUN":
            steps.append(("run", " ".join(json.loads(arg)) if arg.startswith("[") else arg))
        else:
            raise ValueError(f"{dockerfile}: instruction {op} is not supported without Docker")
    cwd = config.get("environment", {}).get("workdir") or (str(workdir) if text else "/app")
    if cwd == "/":
        cwd = "/app"  # the rollout needs a directory of its own
    mounts = _roots([cwd, *FIXED])
    for _, (_, dest) in (s for s in steps if s[0] == "copy"):
        if not any(PurePosixPath(dest).is_relative_to(m) for m in mounts):
            raise ValueError(f"{dockerfile}: COPY to {dest}: only {', '.join(mounts)} are the "
                             "rollout's own without Docker")
    return {"instruction": (root / "instruction.md").read_text(), "config": config,
            "cwd": cwd, "env": env, "steps": steps, "mounts": mounts}


def _roots(paths: list[str]) -> list[str]:
    """The paths none of which lies below another."""
    ps = sorted({PurePosixPath(p) for p in paths}, key=lambda p: len(p.parts))
    return sorted(str(p) for i, p in enumerate(ps)
                  if not any(p.is_relative_to(q) for q in ps[:i]))


def _resolve(env: dict[str, str]) -> dict[str, str]:
    """Harbor's ${VAR} / ${VAR:-default} templates, from this process's environment."""
    return {k: re.sub(r"\$\{(\w+)(:-([^}]*))?\}", lambda m: os.environ.get(m[1], m[3] or ""),
                      str(v)) for k, v in env.items()}


class HarborEpisode(Episode):
    """One task in one Sandbox: the command agent works in `workdir` (a path inside);
    `score` runs the task's tests; `verifier_status` says how the verifier ended."""

    def __init__(self, folder: Path, spec: dict[str, Any], sandbox: Any) -> None:
        env = {**spec["env"], **_resolve(spec["config"].get("environment", {}).get("env", {}))}
        super().__init__([{"role": "user", "content": spec["instruction"]}],
                         workdir=Path(spec["cwd"]), env=env)
        self.folder, self.spec, self.sandbox = folder, spec, sandbox

    def host(self, inside: str) -> Path:
        """The host path of `inside` (a path under one of the sandbox's mounts)."""
        for point, where in self.sandbox.mounts.items():
            if PurePosixPath(inside).is_relative_to(point):
                return where / PurePosixPath(inside).relative_to(point)
        raise ValueError(f"{inside} is not in the rollout's sandbox")

    async def run(self, command: str, timeout_s: float, env: dict[str, str]) -> Any:
        """`command` by sh inside, in the workdir; EnvironmentError if the sandbox failed it."""
        try:
            done = await self.sandbox.run(["sh", "-c", command], timeout_s=timeout_s, env=env,
                                          cwd=str(self.workdir))
        except SandboxError as e:  # closed or unusable
            raise EnvironmentError(f"sandbox: {e}") from None
        if done.returncode is None or (done.returncode == -9 and not done.timed_out):
            raise EnvironmentError(f"sandbox process lost: {done.stderr.strip()[-300:]}")
        return done

    async def build(self) -> None:
        """The environment/ Dockerfile's COPY and RUN steps, in order."""
        context = self.folder / "environment"
        for d in ("agent", "verifier", "artifacts"):
            self.host(f"/logs/{d}").mkdir(parents=True, exist_ok=True)
        self.host(str(self.workdir)).mkdir(parents=True, exist_ok=True)
        timeout = float(self.spec["config"].get("environment", {}).get("build_timeout_sec", 600))
        for op, arg in self.spec["steps"]:
            if op == "copy":
                sources, dest = arg
                for source in sources:
                    _copy(context / source, self.host(dest), dest.endswith("/") or
                          len(sources) > 1)
                continue
            done = await self.run(arg, timeout, self.env)
            if done.returncode != 0:
                raise EnvironmentError(f"environment build: RUN {arg!r} exit "
                                       f"{done.returncode}: {done.stderr.strip()[-300:]}")

    async def solve(self) -> int | None:
        """Harbor's oracle: solution/ to /solution, solve.sh run in the workdir; its exit code."""
        _copy(self.folder / "solution", self.host("/solution"), True)
        env = {**self.env, **_resolve(self.spec["config"].get("solution", {}).get("env", {}))}
        return (await self.run("bash /solution/solve.sh", 600.0, env)).returncode

    async def score(self, answer: str | None, messages: list[dict[str, Any]]) -> float:
        verifier = self.spec["config"].get("verifier", {})
        logs = self.host("/logs/verifier")
        logs.mkdir(parents=True, exist_ok=True)
        for name in ("reward.txt", "reward.json"):
            (logs / name).unlink(missing_ok=True)
        tests = self.host("/tests")
        shutil.rmtree(tests, ignore_errors=True)
        _copy(self.folder / "tests", tests, True)
        (tests / "test.sh").chmod(0o755)
        env = {**self.env, **_resolve(verifier.get("env", {}))}
        done = await self.run("/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1",
                              float(verifier.get("timeout_sec", 600.0)), env)
        self.verifier_status = "timeout" if done.timed_out else "error"
        if done.timed_out:
            return 0.0
        try:
            reward, self.verifier_status = _reward(logs), "ok"
        except (OSError, ValueError, TypeError):
            return 0.0
        return reward


def _reward(logs: Path) -> float:
    """reward.json ("reward", or its only value) else reward.txt, as Harbor reads them."""
    if (logs / "reward.json").exists():
        data = json.loads((logs / "reward.json").read_text())
        values = data if isinstance(data, dict) else {"reward": data}
        if "reward" not in values and len(values) != 1:
            raise ValueError(f"reward.json has {sorted(values)}, none named 'reward'")
        value = values.get("reward", next(iter(values.values()), None))
    else:
        value = (logs / "reward.txt").read_text()
    if not math.isfinite(value := float(value)):
        raise ValueError(f"reward {value!r} is not a finite number")
    return value


def _copy(source: Path, dest: Path, into: bool) -> None:
    """Docker's COPY of `source` to `dest` (into the directory `dest` when `into`)."""
    if source.is_dir():
        shutil.copytree(source, dest, dirs_exist_ok=True)
        return
    target = dest / source.name if into or dest.is_dir() else dest
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)


class Adapter(Environment):
    """`[tasks] env`: a Harbor task folder or a folder of them. `params`: `eval` (a folder of
    held-out tasks; default: `eval_fraction` (0.2, rounded down) of the tasks, a fixed draw)."""

    standard = "harbor"
    params_known = ("eval", "eval_fraction")
    agent = "command"
    sandboxed = True

    def folders(self, split: str) -> list[Path]:
        """The split's task folders (sorted; a fixed draw for the held-out part)."""
        if unknown := set(self.params) - {"eval", "eval_fraction"}:
            raise ValueError(f"unknown Harbor params {sorted(unknown)} (eval, eval_fraction)")
        root = (self.base_dir / self.location).resolve()
        if split == "eval" and self.params.get("eval"):
            root = (self.base_dir / self.params["eval"]).resolve()
        if not root.is_dir():
            raise ValueError(f"{root}: no such folder of Harbor tasks")
        found = sorted(p.parent for p in root.glob("*/task.toml")) or (
            [root] if (root / "task.toml").is_file() else [])
        if not found:
            raise ValueError(f"{root}: no Harbor task (a folder with task.toml)")
        for folder in found:
            load(str(folder))  # a task that cannot build fails the run's start
        if self.params.get("eval"):
            return found
        fraction = self.params.get("eval_fraction", 0.2)
        if not isinstance(fraction, int | float) or not 0 <= fraction < 1:
            raise ValueError(f"params.eval_fraction: a number in [0, 1), got {fraction!r}")
        held = set(random.Random(0).sample(found, int(len(found) * fraction)))
        return [p for p in found if (p in held) == (split == "eval")]

    def tasks(self, split: str, size: int, seed: int) -> list[dict[str, Any]]:
        folders = self.folders(split)
        out: list[dict[str, Any]] = []
        rng = random.Random(seed)
        while folders and len(out) < size:
            for folder in rng.sample(folders, len(folders))[: size - len(out)]:
                out.append({"question": load(str(folder))["instruction"],
                            "harbor_task": str(folder)})
        return out

    def mounts(self, task: dict[str, Any]) -> list[str]:
        return load(task["harbor_task"])["mounts"]

    async def open(self, task: dict[str, Any], sandbox: Any = None) -> Episode:
        if sandbox is None:
            raise EnvironmentError("Harbor tasks need a sandbox (none was opened)")
        folder = Path(task["harbor_task"])
        episode = HarborEpisode(folder, load(str(folder)), sandbox)
        await episode.build()
        return episode
