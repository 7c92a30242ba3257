"""tinker-cookbook's smallest recipes (recipes/sl_loop.py, recipes/rl_loop.py), unmodified, as
subprocesses against `forgerl serve` (a subprocess too) on a tiny Qwen3-architecture model with
the real Qwen3 tokenizer (.cache/families/qwen3), served as "Qwen/Qwen3-4B-Instruct-2507" (a
name the cookbook's model_info maps to its qwen3_instruct renderer), fully offline."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (setup.sh)")

from safetensors.torch import load_file
from transformers import AutoTokenizer

from tests.families import ROOT as FAMILIES
from tests.tinker.offline_hub import hub_dataset, hub_model, tiny_qwen3

SERVED = "Qwen/Qwen3-4B-Instruct-2507"
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
QUESTIONS = [(f"What is {a} plus {b}?", a + b) for a, b in
             ((2, 3), (1, 4), (3, 2), (4, 1), (0, 5), (5, 0), (2, 3), (1, 4))]


def _chat(tokenizer, turns: list[tuple[str, str]]) -> list[int]:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return tokenizer.encode(text + "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """(work dir, env) with the offline HF home and a running `forgerl serve` (base_url in
    env["BASE_URL"])."""
    qwen3 = FAMILIES / "qwen3"
    if not (qwen3 / "tokenizer.json").is_file():
        pytest.skip("the qwen3 family is not built (scripts/families.py, run by setup.sh)")
    work = tmp_path_factory.mktemp("cookbook")
    home = work / "hf"
    tok = AutoTokenizer.from_pretrained(qwen3)
    answers = [[*tok.encode(f"\\boxed{{{n}}}"), tok.eos_token_id] for n in (5, 7)]
    shot = [("user", "How many r's are in strawberry?" + SUFFIX), ("assistant", "\\boxed{3}")]
    teach = [(_chat(tok, [*turns, ("user", q + SUFFIX)]), a)
             for turns in ([], shot) for q, _ in QUESTIONS[:2] for a in answers]
    model = tiny_qwen3(qwen3, work / "tiny-qwen3", teach)  # answers 5 or 7, about evenly
    hub_model(home, SERVED, model)
    hub_dataset(home, "openai/gsm8k", "main", {"train": [
        {"question": q, "answer": f"{q} It is {n}.\n#### {n}"} for q, n in QUESTIONS]})
    hub_dataset(home, "HuggingFaceH4/no_robots", "default", {"train": [
        {"prompt": q, "prompt_id": str(i), "category": "Chat",
         "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": str(n)}]}
        for i, (q, n) in enumerate(QUESTIONS)]})
    (work / "serve.toml").write_text(
        f'run_dir = "{work / "run"}"\n[model]\npath = "{model}"\n'
        f'[serve]\nport = 0\nserved_model_name = "{SERVED}"\n')
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TINKER_API_KEY": "tml-any", "TINKER_TELEMETRY": "0",
           "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "forgerl", "serve", str(work / "serve.toml")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
    for line in server.stdout:
        if "Tinker API at" in line:
            env["BASE_URL"] = line.split(" at ")[1].split()[0]
            break
    else:
        pytest.fail(f"forgerl serve exited {server.wait()}")
    yield work, env
    server.kill()
    server.wait()


def run_recipe(work: Path, env: dict[str, str], recipe: str, *args: str) -> list[dict]:
    log = work / recipe
    done = subprocess.run(
        [sys.executable, "-m", f"tinker_cookbook.recipes.{recipe}", f"base_url={env['BASE_URL']}",
         f"model_name={SERVED}", f"log_path={log}", "lora_rank=8", *args],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    print(recipe, json.dumps(metrics))
    assert metrics and all(math.isfinite(v) for m in metrics for v in m.values()
                           if isinstance(v, float))
    final = json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])
    adapter = load_file(str(_folder(work, final["sampler_path"]) / "adapter_model.safetensors"))
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # it trained
    return metrics


def _folder(work: Path, path: str) -> Path:
    return work / "run" / "tinker" / Path(path.removeprefix("tinker://"))


def test_sl_loop_runs_unmodified(offline):
    work, env = offline
    metrics = run_recipe(work, env, "sl_loop", "batch_size=2", "max_steps=3",
                         "learning_rate=0.01")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert metrics[-1]["train_mean_nll"] < metrics[0]["train_mean_nll"]


def test_rl_loop_runs_unmodified(offline):
    work, env = offline
    metrics = run_recipe(work, env, "rl_loop", "batch_size=2", "group_size=4", "max_steps=2",
                         "max_tokens=12", "loss_fn=importance_sampling", "learning_rate=0.01")
    assert [m["step"] for m in metrics] == [0, 1]
    assert any(m["reward/total"] > 0 for m in metrics)  # the format is sampled and rewarded
