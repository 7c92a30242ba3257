"""Generate a small set of Harbor tasks offline: file-editing and shell tasks, each a Harbor task
folder (instruction.md, task.toml, environment/Dockerfile with its build context,
tests/test.sh writing /logs/verifier/reward.txt, solution/solve.sh).

    python examples/harbor_tasks/generate.py [OUT_DIR] [--count N]

OUT_DIR defaults to examples/harbor_tasks/tasks. Deterministic: the same N gives the same
tasks. Stdlib only (it imports nothing from ForgeRL).
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "lemon", "piano", "comet"]
TOML = """schema_version = "1.1"

[metadata]
category = "{kind}"
difficulty = "easy"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 60.0
cpus = 1
memory_mb = 512
"""
REWARD = """
if {check}; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def task(kind: str, rng: random.Random) -> tuple[str, dict[str, str], str, str]:
    """(instruction, starting files in /app, the test's shell condition, the solution)."""
    a, b = rng.sample(WORDS, 2)
    if kind == "create":
        return (f"Create a file named {a}.txt in the current directory containing exactly the "
                f"word {b}.", {}, f'[ "$(cat /app/{a}.txt)" = "{b}" ]',
                f"echo {b} > {a}.txt")
    if kind == "rename":
        return (f"Rename the file {a}.txt to {b}.txt.", {f"{a}.txt": f"{a}\n"},
                f'[ ! -e /app/{a}.txt ] && [ "$(cat /app/{b}.txt)" = "{a}" ]',
                f"mv {a}.txt {b}.txt")
    if kind == "count":
        n = rng.randint(2, 9)
        lines = "".join(f"{rng.choice(WORDS)}\n" for _ in range(n))
        return (f"Write the number of lines of {a}.txt into out.txt.", {f"{a}.txt": lines},
                f'[ "$(tr -d " \\n" < /app/out.txt)" = "{n}" ]', f"wc -l < {a}.txt > out.txt")
    if kind == "delete":
        return (f"Delete the file {a}.txt and keep {b}.txt.", {f"{a}.txt": "x\n",
                                                                 f"{b}.txt": "y\n"},
                f"[ ! -e /app/{a}.txt ] && [ -e /app/{b}.txt ]", f"rm {a}.txt")
    # append
    return (f"Append a line containing {b} to the end of {a}.txt.", {f"{a}.txt": f"{a}\n"},
            f'[ "$(tail -n 1 /app/{a}.txt)" = "{b}" ] && [ "$(head -n 1 /app/{a}.txt)" = "{a}" ]',
            f"echo {b} >> {a}.txt")


def write(root: Path, name: str, kind: str, rng: random.Random) -> None:
    instruction, files, check, solution = task(kind, rng)
    folder = root / name
    (folder / "environment" / "files").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "solution").mkdir()
    (folder / "instruction.md").write_text(instruction + "\n")
    (folder / "task.toml").write_text(TOML.format(kind=kind))
    for file, text in files.items():
        (folder / "environment" / "files" / file).write_text(text)
    (folder / "environment" / "Dockerfile").write_text(
        "FROM ubuntu:24.04\nWORKDIR /app\nCOPY files/ /app/\n")
    (folder / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n" + REWARD.format(check=check).lstrip())
    (folder / "solution" / "solve.sh").write_text(f"#!/bin/bash\ncd /app\n{solution}\n")
    for script in (folder / "tests" / "test.sh", folder / "solution" / "solve.sh"):
        script.chmod(0o755)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).parent / "tasks"))
    parser.add_argument("--count", type=int, default=40)
    args = parser.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = random.Random(0)
    kinds = ["create", "rename", "count", "delete", "append"]
    for i in range(args.count):
        kind = kinds[i % len(kinds)]
        write(root, f"{kind}-{i:03d}", kind, rng)
    print(f"{args.count} Harbor tasks in {root}")


if __name__ == "__main__":
    main()
