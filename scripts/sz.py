"""Code-line budget of the core package (tinygrad's sz.py idea): counts non-blank, non-comment,
non-docstring lines per module of forgerl/ and fails when the total exceeds MAX_LINES.

    python scripts/sz.py          # prints a table; exit 1 over budget
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# 7,000 was STYLE.md's v1 target (one machine); raised to 7,500 for the cluster and engine
# adapters (forgerl/cluster.py, engines/remote.py) that take ForgeRL beyond one process, and to
# 7,900 for the in-process vLLM engine (engines/vllm.py, 176 lines), FSDP2 sharding and the
# broadcast weight transport (about 120 lines in trainer/data_parallel.py and cluster.py), and
# to 7,950 for mixed precision ([engine] dtype, [trainer] autocast, engines/local.engine_dtype)
# and the batched inverse-CDF sampler (about 30 lines), and to 8,160 for the agent fork server
# (agents/forkserver.py, 193 lines: a Python agent's imports once per run instead of once per
# rollout, about 29 % of a chain_sum run's CPU), and to 8,170 for [tasks] eval_concurrency
# (held-out latency without queueing, issue 11) and ManagedContext.tokens (a harness's budget),
# and to 8,200 for the fork server by default (agents/forkserver.script_imports: an unset
# `[agent] preload` preloads the script's installed imports; crash_check.py's one-call
# rollouts: 5.4 → 1.0 s), and to 8,360 for the supervised warm start (trainer/warmstart.py,
# [warmstart], Trainer.supervised_step and nll_loss: about 135 lines; issue 11's cold start
# for an action the policy never samples), and to 8,380 for the engine's oneDNN-packed linears
# and prefill-free sibling rows (engines/local.pack_linears and _prefill_wave: a SmolLM2 fp32
# decode step at 10 rows 21 % faster on a 2-core AVX2 EPYC; a group's later rows run no
# forward of their own), and to 8,430 for forgerl/cpu_share.py and its hooks in the engine,
# trainer and controller (while the trainer trains beside a decoding local engine each gets
# half of the CPU's threads instead of both running all of them: on the 2-core EPYC, decode
# 56.7 -> 75.0 tok/s with train steps no slower), and to 8,440 for admitting no more tasks than
# the steps left can train (no group generated only to be cancelled at the end of a run) and a
# `type` override that replaces the file's table of the old type, and to 8,445 for
# controller.share_malloc_arena (every thread allocates from one glibc arena, so the trainer's
# freed activations can hold the engine's KV caches: the main job's peak RSS under 5 GiB), and
# to 8,505 for block-sparse tree attention (trainer/attention.py tree_blocks, tree_sdpa,
# checked_attn_implementation: a query block attends over only the keys it may see, not the
# dense N x N mask; SmolLM2 fwd+bwd of a 1,110-token two-group tree 10.3 -> 8.1 s), and to
# 8,580 for a start-up that overlaps its imports (scoring.submit: task generation and the reward
# fork server's reasoning-gym import; agent fork servers started before torch; no interpreter
# teardown): the tiny-model crash_check.py 55.9 -> 33 s on the 2-core EPYC, and to 8,590 for
# one OpenMP team at a time on a shared CPU (cpu_share.single_threaded_caller, the trainer's
# fixed share, controller._shares_cpu): a decode step from the engine's thread 101 -> 73 ms,
# and to 8,600 for the CUDA allocator's peak in every step record (controller.cuda_peak_gib,
# issue 14 item 4), and to 8,625 for the gateway's tool check (gateway.core.tool_problem: an
# invalid JSON Schema, an empty or repeated name is a 400 naming the tool, CASES.md C15) and a
# one-line error for resuming a run directory with another model, and to 8,645 for GET
# /v1/models/{id} (the openai client's models.retrieve) and refusing an agent command that
# cannot start before any rollout (controller.check_agent_command), and to 8,650 for one-line
# errors naming gateway.host / gateway.port and run_dir instead of OSError tracebacks' names,
# and to 8,670 for refusing a message or prompt that must exceed max_model_len before tokenizing
# it (Renderer.min_tokens; a 60 MB body had held the gateway's event loop for 95-136 s), and to
# 8,685 for naming the settings a resume changes (controller.config_changes; it was silent), and
# to 8,695 for caching tool-schema checks (gateway.core.schema_problem: 0.43 ms -> 9 us a tool),
# and to 8,710 for reading a lone surrogate escape as U+FFFD (it failed the call as bad JSON),
# and to 8,725 for streaming /v1/completions as the engine samples (it sent all at the end),
# and to 8,740 for weight-sync deltas through the Router to every instance (it took full only),
# and to 8,780 for malformed field values as 400s, a 500 that keeps the keep-alive connection
# (Starlette re-raised and uvicorn reset it) and the C09 floor over every rendered text,
# and to 8,810 for error params that name body fields (no pydantic union members) and
# invalid_value for values out of range (they were invalid_type),
# and to 8,850 for a second breaker's finds: no optimizer step on a NaN loss (NaN weights were
# checkpointed), agent logs cut per episode (6.1 GB in 28 s), a failure streak per domain,
# metrics lines that are no record, per-domain eval settings and warm start after RL refused,
# and to 8,875 for a third: the floor counts </think> text where it is rendered, error params
# name the deepest real field, and a Responses stream fails with a Responses error event,
# and to 8,900 for the engine's decode attention without enable_gqa (CPU bf16: 4-6x slower),
# and to 8,925 for messages missing a required field as 400s (they were rendered as empty),
# and to 8,950 for logprob bytes of tokens that split a character (they were U+FFFD's).
MAX_LINES = 8950
ROOT = Path(__file__).resolve().parents[1] / "forgerl"


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not a comment, not inside a docstring."""
    source = path.read_text()
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                doc_lines.update(range(value.lineno, (value.end_lineno or value.lineno) + 1))
    return sum(
        1
        for i, line in enumerate(source.splitlines(), start=1)
        if line.strip() and not line.strip().startswith("#") and i not in doc_lines
    )


def table() -> dict[str, int]:
    """Module path (relative to forgerl/) → code lines."""
    return {str(p.relative_to(ROOT)): code_lines(p) for p in sorted(ROOT.rglob("*.py"))}


def main() -> int:
    counts = table()
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {name}")
    total = sum(counts.values())
    print(f"{total:6d}  total (budget {MAX_LINES})")
    return 0 if total <= MAX_LINES else 1


if __name__ == "__main__":
    sys.exit(main())
