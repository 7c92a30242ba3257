"""Task file for the coding-CLI job: tiny file-editing tasks, generated offline, each with the
files it starts from and a check script.

A ForgeRL task file (`[tasks] dataset = "tasks.py"`). A task is its question alone: the agent
only ever receives the question, so everything else is a pure function of it: `workspace(q)`
gives the files the rollout's working directory starts with (their text drawn from a generator
seeded by the question), `check_script(q)` a Python script that exits 0 when the directory it
runs in holds the asked-for result and 1 (with the reason on stderr) otherwise. The agent
(`agent.py`) runs that script in the rollout's own working directory after Pi has finished and
prints `pass` or `fail`; `score` turns that into the reward (1.0 / 0.0, no partial credit).

The four kinds, one tool call each for an agent that gets it right:

    create   Create a file named fruit.txt containing the word banana.
    replace  In notes.txt, replace the word red with blue.
    append   Append a line with the word seven to list.txt.
    delete   Delete the file old.txt.
"""

from __future__ import annotations

import random
import re

KINDS = ("create", "replace", "append", "delete")
WORDS = ("apple", "banana", "cherry", "lemon", "mango", "grape", "peach", "plum", "red", "blue",
         "green", "yellow", "black", "white", "one", "two", "three", "four", "five", "six",
         "seven", "eight", "nine", "ten", "cat", "dog", "bird", "fish", "horse", "mouse", "sun",
         "moon", "star", "rain", "snow", "wind", "river", "stone", "tree", "book")
NAMES = ("notes", "list", "todo", "words", "fruit", "colors", "animals", "data", "hello",
         "items", "names", "old", "draft", "log")
TEMPLATES = {
    "create": "Create a file named {name} containing the word {word}.",
    "replace": "In {name}, replace the word {old} with {new}.",
    "append": "Append a line with the word {word} to {name}.",
    "delete": "Delete the file {name}.",
}
_PATTERNS = {kind: re.compile("^" + re.escape(t).replace(r"\{", "{").replace(r"\}", "}")
                              .format(name=r"(?P<name>[a-z]+\.txt)", word=r"(?P<word>[a-z]+)",
                                      old=r"(?P<old>[a-z]+)", new=r"(?P<new>[a-z]+)") + "$")
             for kind, t in TEMPLATES.items()}


def make_tasks(size: int, seed: int, kinds: list[str] | None = None) -> list[dict]:
    """`size` tasks {"question", "answer", "metadata": {"kind"}}, deterministic in `seed`; the
    kinds cycle through `kinds` (default all four, in KINDS order). "answer" is what the agent
    prints for a solved task ("pass"). Raises ValueError for an unknown kind."""
    kinds = list(kinds or KINDS)
    if bad := [k for k in kinds if k not in KINDS]:
        raise ValueError(f"unknown kinds {bad}; choose from {list(KINDS)}")
    rng = random.Random(seed)
    tasks = []
    for i in range(size):
        kind = kinds[i % len(kinds)]
        old, new = rng.sample(WORDS, 2)
        question = TEMPLATES[kind].format(name=rng.choice(NAMES) + ".txt", word=new, old=old,
                                          new=new)
        tasks.append({"question": question, "answer": "pass", "metadata": {"kind": kind}})
    return tasks


def parse(question: str) -> tuple[str, dict[str, str]]:
    """(kind, fields) of a question made by `make_tasks`; ValueError for any other text."""
    for kind, pattern in _PATTERNS.items():
        if match := pattern.match(question.strip()):
            return kind, match.groupdict()
    raise ValueError(f"not a coding_cli task: {question!r}")


def workspace(question: str) -> dict[str, str]:
    """The files (name -> text) the task's working directory starts with: for "replace" a line
    of 4 words holding the old word once, for "append" 2-3 lines of one word, for "delete" the
    file to delete, plus for every kind but "create" an untouched `readme.txt`."""
    kind, f = parse(question)
    rng = random.Random(question)
    others = [w for w in WORDS if w not in (f.get("word"), f.get("old"), f.get("new"))]
    files = {} if kind == "create" else {"readme.txt": " ".join(rng.sample(others, 3)) + "\n"}
    if kind == "replace":
        words = rng.sample(others, 3)
        words.insert(rng.randrange(4), f["old"])
        files[f["name"]] = " ".join(words) + "\n"
    elif kind == "append":
        files[f["name"]] = "".join(w + "\n" for w in rng.sample(others, rng.randint(2, 3)))
    elif kind == "delete":
        files[f["name"]] = rng.choice(others) + "\n"
    return files


def expected(question: str) -> dict[str, str | None]:
    """What the check asks of the directory: file name -> its words in order, one line of
    them per line of the file ("" for an empty file), or None for "must not exist"."""
    kind, f = parse(question)
    start = workspace(question)
    want: dict[str, str | None] = {name: text for name, text in start.items()}
    if kind == "create":
        want[f["name"]] = f["word"] + "\n"
    elif kind == "replace":
        want[f["name"]] = " ".join(f["new"] if w == f["old"] else w
                                   for w in start[f["name"]].split()) + "\n"
    elif kind == "append":
        want[f["name"]] = start[f["name"]] + f["word"] + "\n"
    else:
        want[f["name"]] = None
    return want


CHECK = '''\
import os, sys
WANT = {want!r}
def words(text):
    return [line.split() for line in text.splitlines() if line.strip()]
for name, text in WANT.items():
    if text is None:
        if os.path.exists(name):
            sys.exit(f"{{name}} still exists")
        continue
    if not os.path.isfile(name):
        sys.exit(f"{{name}} is missing")
    with open(name, errors="replace") as f:
        got = f.read()
    if words(got) != words(text):
        sys.exit(f"{{name}} holds {{got[:200]!r}}, expected {{text!r}}")
'''


def check_script(question: str) -> str:
    """Python source that exits 0 when the current directory holds `expected(question)`:
    each file's lines, split into words, equal the expected ones (blank lines and spacing do
    not count), and a file to delete is gone; other files may exist. Else it exits 1 with the
    first difference on stderr."""
    return CHECK.format(want=expected(question))


def score(task: dict, answer: str) -> float:
    """1.0 when the agent reported that the check passed (`pass`), else 0.0."""
    return 1.0 if answer.strip().lower() == "pass" else 0.0
