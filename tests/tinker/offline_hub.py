"""An offline HuggingFace home for the tinker-cookbook recipes: a hub cache holding a tokenizer
under a model name the cookbook knows, and `datasets` caches of generated data under the hub
names the recipes load (openai/gsm8k "main", HuggingFaceH4/no_robots), so that
`AutoTokenizer.from_pretrained(name)` and `datasets.load_dataset(name, ...)` resolve with
HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1. Generated data only; nothing is downloaded.

datasets (4.x, 5.x) resolves a hub dataset offline from its prepared cache,
`<HF_HOME>/datasets/<namespace>___<name>/<config>/<version>/<hash>/` (dataset_info.json naming
the config, `<name>-<split>.arrow`): built here by the packaged parquet builder and copied
under that name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from datasets.data_files import DataFilesDict
from datasets.packaged_modules.parquet.parquet import Parquet
from transformers import AutoTokenizer, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

REV = "0" * 40


def hub_model(home: Path, repo: str, folder: Path) -> None:
    """Put the files of `folder` (a tokenizer, a config) in the hub cache as `repo`@main."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(REV)
    shutil.copytree(folder, root / "snapshots" / REV, dirs_exist_ok=True)


def hub_dataset(home: Path, repo: str, config: str, splits: dict[str, list[dict]]) -> None:
    """Cache `splits` (rows as dicts) as the prepared hub dataset `repo`, config `config`."""
    work = home / "build" / repo.replace("/", "__")
    files = {}
    for split, rows in splits.items():
        files[split] = [str(work / f"{split}.parquet")]
        work.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), files[split][0])
    name = repo.split("/")[-1]
    builder = Parquet(cache_dir=str(work / "cache"), dataset_name=name, config_name=config,
                      data_files=DataFilesDict.from_patterns(files))
    builder.download_and_prepare()
    dest = home / "datasets" / repo.replace("/", "___") / config / "0.0.0" / ("0" * 16)
    shutil.copytree(builder.cache_dir, dest)


def tiny_qwen3(tokenizer_dir: Path, out: Path, teach: list[tuple[list[int], list[int]]] = (),
               steps: int = 60) -> Path:
    """A random Qwen3-architecture model (hidden 64, 2 layers) with the tokenizer of
    `tokenizer_dir` saved in `out`; `teach` (prompt ids, completion ids) pairs are trained for
    `steps` Adam steps on the completion tokens so that sampling gives them (a format the
    recipe rewards)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id))
    if teach:
        _teach(model, teach, steps)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _teach(model: PreTrainedModel, pairs: list[tuple[list[int], list[int]]], steps: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for prompt, completion in pairs:
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(completion))
        opt.zero_grad()
        loss.backward()
        opt.step()
