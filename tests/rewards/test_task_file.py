"""User task files (`[tasks] dataset = "NAME.py"`): found relative to the config file, their
tasks carry the file's absolute path, their `score` is the verifier, and a missing file or a
file without make_tasks / score is a one-line config error naming tasks.dataset."""

from __future__ import annotations

import pytest

from forgerl.config import ConfigError, load_config
from forgerl.controller import make_task_sets
from forgerl.rewards.reasoning_gym import score

TASKS = '''
def make_tasks(size, seed, base=10):
    return [{"question": f"{seed}+{i}?", "answer": str(seed + i + base)} for i in range(size)]

def score(task, answer):
    return 1.0 if answer.strip() == task["answer"] else 0.25
'''


def write_config(tmp_path, dataset: str):
    (tmp_path / "cfg").mkdir(exist_ok=True)
    config = tmp_path / "cfg" / "run.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n[agent]\ncommand = ["true"]\n'
                      f'[tasks]\ndataset = "{dataset}"\nparams = {{ base = 100 }}\n'
                      'size = 6\neval_size = 2\nseed = 5\n')
    return config


def test_task_file_relative_to_the_config_gives_tasks_and_scores(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the config's directory
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "my_tasks.py").write_text(TASKS)
    config = load_config(write_config(tmp_path, "my_tasks.py"))
    path = str(tmp_path / "cfg" / "my_tasks.py")
    assert config.tasks.dataset == path
    train, held = make_task_sets(config)
    assert [t["question"] for t in held] == ["1000008+0?", "1000008+1?"]  # seed + 1_000_003
    assert [t["answer"] for t in train[:2]] == ["105", "106"]
    assert all(t["dataset"] == path and t["metadata"] == {} for t in train + held)
    assert score(train[0], " 105") == 1.0 and score(train[0], "7") == 0.25
    assert score(train[0], None) == 0.0


@pytest.mark.parametrize(("body", "message"), [
    (None, "task file not found"),
    ("def make_tasks(size, seed):\n    return []\n", "does not define score"),
])
def test_bad_task_file_is_a_one_line_config_error(tmp_path, body, message):
    (tmp_path / "cfg").mkdir()
    if body is not None:
        (tmp_path / "cfg" / "t.py").write_text(body)
    config = load_config(write_config(tmp_path, "t.py"))
    with pytest.raises(ConfigError, match=f"^tasks.dataset: .*{message}") as e:
        make_task_sets(config)
    assert "\n" not in str(e.value)
