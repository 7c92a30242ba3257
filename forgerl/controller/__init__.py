"""The single controller: builds every service in one process and runs the asynchronous RL loop.

`run(config)` is what `forgerl train` calls (loop.py); `run(config, agent=fn)` runs an async
Python callable `fn(task, base_url, api_key) -> answer` instead of the configured command.
Every service is also a plain object usable on its own (tests build them directly).

    loop.py      run: admit, next_batch, train, sync_weights, evaluate, log, checkpoint
    progress.py  step timing and the progress bar
    startup.py   start_services: build, start and stop the services
    services.py  Services and the training steps (train, sync_weights, checkpoint, log)
    rollouts.py  admit, rollout groups, agents, scoring, held-out evaluation
    rundir.py    RUN_DIR: lock, resume from the checkpoint, config.json
    tasks.py     training and held-out task sets
    warmstart.py supervised warm start on demonstrations
    memory.py    glibc heap trimming and arena sharing, memory metrics

No module here imports torch at import time (`cli.main` calls `share_malloc_arena` first).
"""

from forgerl.controller.loop import run, serve_gateway, summary
from forgerl.controller.memory import cuda_peak_gib, release_heap, share_malloc_arena
from forgerl.controller.rollouts import check_agent_command, rollout_seed
from forgerl.controller.rundir import config_changes, lock_run_dir
from forgerl.controller.services import Services
from forgerl.controller.startup import start_services
from forgerl.controller.tasks import make_task_sets

__all__ = ["Services", "check_agent_command", "config_changes", "cuda_peak_gib",
           "lock_run_dir", "make_task_sets", "release_heap", "rollout_seed", "run", "serve_gateway",
           "share_malloc_arena", "start_services", "summary"]
