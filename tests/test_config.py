"""The config tree: TOML + dotted overrides, typed unions with build(), one-line errors that name
the field and both values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forgerl.config import ConfigError, load_config, parse_overrides
from forgerl.trainer.losses import cispo_loss, tis_loss


def test_overrides_parse_toml_values():
    assert parse_overrides(["--trainer.lr", "1e-6", "--max_steps=3", "--agent.command", '["a"]',
                            "--trainer.merge_prefixes", "false", "--run_dir", "runs/x"]) == [
        ("trainer.lr", 1e-6), ("max_steps", 3), ("agent.command", ["a"]),
        ("trainer.merge_prefixes", False), ("run_dir", "runs/x")]


def test_toml_file_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("max_steps = 7\n[agent]\ncommand = ['python', 'a.py']\n"
                    "[scheduler]\npolicy = {type = 'windowed_fifo', window = 3}\n")
    config = load_config(path, ["--scheduler.policy.window", "5", "--trainer.lr", "2e-6"])
    assert config.max_steps == 7 and config.trainer.lr == 2e-6
    assert config.scheduler.policy.type == "windowed_fifo" and config.scheduler.policy.window == 5
    # a new type drops the file's keys of the old one; a key given with it must fit it
    assert load_config(path, ["--scheduler.policy.type", "fifo"]).scheduler.policy.type == "fifo"
    # fffo has no window
    with pytest.raises(ConfigError, match=r"scheduler\.policy\.window: Extra inputs"):
        load_config(path, ["--scheduler.policy.window", "5", "--scheduler.policy.type", "fffo"])
    assert config.agent.cwd == str(tmp_path)  # relative agent paths resolve next to the config


def test_loss_union_builds_the_chosen_loss():
    lp, blp, adv = torch.tensor([-1.0, -0.5]), torch.tensor([-1.5, -0.4]), torch.tensor([1.0, -1.0])
    cispo = load_config(None, ["--trainer.loss.eps_high", "0.1"]).trainer.loss.build()
    assert torch.equal(cispo(lp, blp, adv, 2)[0], cispo_loss(lp, blp, adv, 2, eps_high=0.1)[0])
    tis_config = load_config(None, ["--trainer.loss", "{type = 'tis', tis_cap = 1.5}"])
    tis = tis_config.trainer.loss.build()
    expected = tis_loss(lp, blp, adv, 2, tis_cap=1.5)[0]
    assert torch.equal(tis(lp, blp, adv, 2)[0], expected)
    # ratio exp(0.5) = 1.6487 is truncated to 1.5: loss = -(1.5*1*-1 + exp(-0.1)*-1*-0.5) / 2
    assert expected.item() == pytest.approx(-(1.5 * -1.0 + torch.exp(torch.tensor(-0.1)).item()
                                              * 0.5) / 2, abs=1e-6)


@pytest.mark.parametrize(("overrides", "message"), [
    (["--trainer.loss.type", "dpo"], "trainer.loss"),
    (["--rollout.max_tokens", "4096"], "rollout.max_tokens (4096) must be < model.max_model_len"),
    (["--scheduler.policy.window", "0"], "scheduler.policy.window"),
    (["stray"], "unexpected argument"),
    (["--trainer.max_row_tokens", "1024"], "trainer.max_row_tokens (1024) must be >= model"),
    (["--scheduler.max_in_flight", "0"], "scheduler.max_in_flight"),
    (["--gateway.model_name", "123"], "gateway.model_name: Input should be a valid string (got "
                                      "123); quote it to pass text: '\"...\"'"),
    (["--scheduler.max_in_flight", "true"], "scheduler.max_in_flight: Input should be a valid "
                                            "integer (got True)"),  # strict: no bool as 1
    (["--engine.bogus", "1"], "engine.bogus: Extra inputs"),  # no union tag in the path
    (["--domains", "[{name = 'a', tasks = {eval_every = 2}}]"], "domains.0: Value error, "
     "tasks.eval_every is the run's, for every domain: set it in [tasks], not in [[domains]]"),
    (["--rollout.group_size", "1"], "rollout.group_size: Input should be greater than or equal "
                                    "to 2"),  # its own baseline: every advantage 0
    (["--gateway.model_name", "''"], "gateway.model_name: String should have at least 1"),
    (["--gateway.admin_key", "'clé'"], "gateway.admin_key: String should match pattern"),
])
def test_errors_are_one_line_and_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_engine_and_cluster_sections(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\ntype = 'remote'\nbase_url = 'http://127.0.0.1:8001'\nretries = 0\n"
                    "[cluster]\nplacement = 'SPREAD'\n")
    config = load_config(path)
    assert (config.engine.type, config.engine.base_url, config.engine.retries) == (
        "remote", "http://127.0.0.1:8001", 0)
    assert config.cluster.backend == "local" and config.cluster.placement == "SPREAD"
    assert load_config(None).engine.type == "local"  # the embedded default
    with pytest.raises(ConfigError, match=r"cluster.backend = \"ray\" places local or vllm"):
        load_config(path, ["--cluster.backend", "ray"])
    assert load_config(None, ["--engine.type", "vllm"]).engine.type == "vllm"
    vllm_actors = load_config(None, ["--engine.type", "vllm", "--engine.instances", "2",
                                     "--engine.max_num_seqs", "8", "--cluster.backend", "ray"])
    assert (vllm_actors.engine.instances, vllm_actors.engine.max_batch_size) == (2, 8)
    with pytest.raises(ConfigError, match=r"instances > 1 .*needs cluster.backend = \"ray\""):
        load_config(None, ["--engine.type", "vllm", "--engine.instances", "2"])
    with pytest.raises(ConfigError, match=r"^engine: .*'sglang'"):
        load_config(None, ["--engine.type", "sglang"])
    with pytest.raises(ConfigError, match=r"cluster\.placement"):
        load_config(None, ["--cluster.placement", "EVERYWHERE"])


def test_readme_vllm_command_loads_the_chain_sum_example():
    """README's `forgerl train examples/chain_sum/config.toml --engine.type vllm`: the override
    replaces the example's local [engine] table (its max_batch_size and dtype "auto" are not
    vLLM's keys), and the example itself loads as written."""
    path = Path(__file__).resolve().parents[1] / "examples" / "chain_sum" / "config.toml"
    local = load_config(path)
    assert (local.engine.type, local.engine.max_batch_size, local.engine.dtype) == (
        "local", 48, "auto")
    vllm = load_config(path, ["--engine.type", "vllm"])
    assert (vllm.engine.type, vllm.engine.dtype, vllm.engine.max_num_seqs) == (
        "vllm", "float32", 64)
