"""The run's task sets: training tasks in queue order and held-out tasks, from [tasks] or the
[[domains]] mix (reasoning-gym datasets, a task file, or an environment: forgerl/tasks/).
`start_services` generates them in the reward fork server's child (`scoring.submit`) while the
policy loads.
"""

from __future__ import annotations

from forgerl.config import Config, ConfigError, TasksConfig
from forgerl.rewards.reasoning_gym import make_tasks
from forgerl.tasks.sources import build_environment


def make_task_sets(config: Config) -> tuple[list[dict], list[dict]]:
    """Training tasks and held-out tasks (another seed; their questions are removed from the
    training set, so evaluation never sees a question that was trained on).

    With `[[domains]]`, every task carries its domain's name ("domain") and the training tasks
    of all domains are interleaved by weight (smooth weighted round robin: of any n consecutive
    tasks, domain d has n * w_d / sum(w) of them, give or take one); the held-out sets are
    concatenated. Raises ConfigError naming `tasks.dataset` / `tasks.params` (or
    `domains.<i>.tasks...`) when reasoning-gym refuses them (its own message, one line).
    """
    if not config.domains:
        return _task_sets(config.tasks, "tasks", None)
    sets = [_task_sets(d.tasks, f"domains.{i}.tasks", d.name)
            for i, d in enumerate(config.domains)]
    weights = [d.weight for d in config.domains]
    credit, cursor, train = [0.0] * len(sets), [0] * len(sets), []
    for _ in range(sum(len(t) for t, _ in sets)):
        credit = [c + w for c, w in zip(credit, weights, strict=True)]
        d = max(range(len(sets)), key=credit.__getitem__)
        credit[d] -= sum(weights)
        train.append(sets[d][0][cursor[d] % len(sets[d][0])])
        cursor[d] += 1
    return train, [task for _, held in sets for task in held]


def _task_sets(t: TasksConfig, where: str, domain: str | None) -> tuple[list[dict], list[dict]]:
    try:
        environment = build_environment(t)
    except ValueError as e:
        raise ConfigError(f"{where}.source: {e}") from None
    if (known := environment and environment.params_known) and set(t.params) - set(known):
        raise ConfigError(f"{where}.params: unknown keys {sorted(set(t.params) - set(known))} "
                          f"for source {t.source!r} (it reads {', '.join(known)})")

    def generate(size: int, seed: int, split: str) -> list[dict]:
        try:
            tasks = (make_tasks(t.dataset, size, seed, **t.params) if environment is None
                     else environment.tasks(split, size, seed))  # type: ignore[arg-type]
        except (AssertionError, TypeError, ValueError, KeyError, OSError) as e:
            named = "not registered" in str(e) or "task file" in str(e)
            field = (f"{where}.env" if environment is not None and not isinstance(e, TypeError)
                     else f"{where}.dataset" if named else f"{where}.params")
            message = (str(e).splitlines() or [""])[0] or type(e).__name__
            if (key := message.partition(": ")[0]).startswith("params.") and ": " in message:
                field, message = f"{where}.{key}", message.partition(": ")[2]  # it named it
            what = f"dataset {t.dataset!r}" if environment is None else f"env {t.env!r}"
            raise ConfigError(f"{field}: {message} ({what}, params {t.params})") from None
        return tasks if domain is None else [{**task, "domain": domain} for task in tasks]

    held_out = generate(t.eval_size, t.seed + 1_000_003, "eval") if t.eval_size else []
    held = {task["question"] for task in held_out}
    train = [task for task in generate(t.size, t.seed, "train") if task["question"] not in held]
    if not train:
        raise ValueError(f"{where}: every training question is also a held-out one; raise "
                         f"{where}.size")
    return train, held_out
