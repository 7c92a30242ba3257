"""Line budget of the core package, per package (tinygrad's sz.py idea; STYLE.md §1.5, §9).

Counts the lines a reader reads — every line that is not blank and not a comment, docstrings
included — per package of forgerl/ (a folder, or a top-level module for the small shared
modules), and fails when one exceeds its budget. A budget moves only with a one-line reason in
the closing note of the change that moves it; it is never logged here.

    python scripts/sz.py          # prints a table; exit 1 when a package is over its budget
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "forgerl"

# Package → most lines (code and docstrings). STYLE.md §2 has the v1 targets these started from.
BUDGETS: dict[str, int] = {
    "agents": 1_295,  # +25 (issue 47): runner.infra_cause, the per-episode kill of escapees;
    # +550 (issue 48): the sandbox (namespaces, cgroups, gateway relay, its PID 1 sandbox_init.py)
    "controller": 1_710,  # +134 (issue 51): scale.py, N gateway workers and their supervisor;
    # +4 (issue 51): config.json keeps no pool password; +20: one database per run (claim_pool);
    # +80 (issue 48): environment episodes, their start/stop, env_seconds,
    # generation_seconds, the episode timeout; +25: command agents in sandboxes ([sandbox] agents,
    # Harbor), verifier statuses, sandboxes_peak; +5: unknown [tasks] params keys are an error,
    # [agent] without a command for tool-agent sources;
    # +20 (issue 46): the generated admin key, the request log wiring;
    # +20 (issue 47): the generation config's eos ids, template variables, per-domain entropy,
    # aborted_infra counts
    "datapool": 775,  # +30 (issue 46): trace, train and request columns, with their migration;
    # +140 (issue 51): PostgresPool, open_pool, the backend hooks of the shared SQLPool;
    # +35 (issue 51): NUL, NaN and out-of-range ints refused alike by both backends;
    # +20 (issue 51): PoolLost, one line when the PostgreSQL server goes away mid-run;
    # +5 (issue 51): redacted() also hides a `password=` URL parameter; +5: claim()
    "engines": 2_805,  # +30 (issue 46): the local sampler's penalties and filters, vLLM params;
    # +25 (issue 47): RemoteEngine's text-only answers (C01)
    "gateway": 5_915,  # +243 (issue 51): front.py, the sticky front of N gateway processes;
    # +13 (issue 51): a lost pool server is a 503, logged once;
    # +71 (issue 48): NeMo-Gym's token ids on Responses items, out and back in;
    # +380 (issue 47): five family tool-call formats, reasoning split + stream;
    # +530 (issue 46): traces, trace rules, untrained models; sampling params;
    # the request policy (kept/approximated/left out, edits.py); observe.py (request log,
    # /metrics), C22/C26; +105 (issue 47): untokenized answers (C01), canonical tool schemas
    # (C15), one key per request on every route (C26), generation-config stop ids, turn ends the
    # real families' templates write (Phi-3.5's trailing eos, GLM's next-turn opener);
    # +65: chat template variables (Renderer.bind, Gateway.renderer_for, the fields row)
    "online": 660,
    "rewards": 300,
    "tasks": 1_600,  # new (issue 48): the environment seam, the tool agent, one adapter per
    # standard (Harbor, ORS, OpenEnv, verifiers, NeMo-Gym, Gymnasium)
    "scheduler": 440,
    "trainer": 2_366,  # +40 (issue 46): a sample chain per trace, [reward] traces, rtg per trace;
    # sampled-with-transforms turns kept as context; +125 (issue 47): one non-finite rule for every
    # loss, entropy of the loss tokens (chunked, per sample, all-reduced over ranks)
    "tinker": 775,  # +25 (issue 50 breaker): sampler cache keyed by save, in-use samplers kept
    "core": 2_695,  # +5 (issue 51): [gateway] processes; +5 [datapool] url (both branches merged);
    # +35 (issue 48): [tasks] source, env, python, params paths; +5: [gateway]
    # responses_token_ids; top-level modules: types, config, ...; +80 (issue 46): trace settings,
    # SamplingParams' top_k, min_p, penalties, check() and transforms(); request_log, metrics;
    # +60 (issue 47): the entropy collapse warning (EntropyWatch, two [trainer] fields),
    # GenerateOutput.text and Completion.check (C01); [gateway] chat_template_kwargs;
    # +35 (issue 48): [sandbox] and types.Limits; +10 (issue 51): [datapool] url, location()
}


def lines(path: Path) -> int:
    """Lines that are not blank and not a comment."""
    return sum(1 for line in path.read_text().splitlines()
               if line.strip() and not line.strip().startswith("#"))


def package(path: Path) -> str:
    """The budget a module counts against: its top-level folder, or "core"."""
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else "core"


def table() -> dict[str, int]:
    """Package → lines."""
    counts = dict.fromkeys(BUDGETS, 0)
    for path in sorted(ROOT.rglob("*.py")):
        counts[package(path)] = counts.get(package(path), 0) + lines(path)
    return counts


def main() -> int:
    counts = table()
    over = False
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        budget = BUDGETS.get(name, 0)
        over |= n > budget
        print(f"{n:6d} / {budget:6d}  {name}{'  OVER' if n > budget else ''}")
    print(f"{sum(counts.values()):6d} / {sum(BUDGETS.values()):6d}  total")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
