"""`forgerl plot RUN_DIR`: a PNG of mean rollout reward and held-out accuracy per step."""

from __future__ import annotations

from pathlib import Path

from forgerl.metrics import read_metrics


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write RUN_DIR/curves.png (or `out`) and return its path.

    Reads metrics.jsonl: records with `reward_mean` (train steps) and `eval_accuracy` (held-out,
    greedy), plus each [[domains]] domain's `domain_<name>_reward_mean` / `_eval_accuracy`.
    Raises FileNotFoundError when the run has no metrics, ValueError when it has none of the
    first two keys.
    """
    import matplotlib  # lazy: optional extra (plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display here

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [(r["step"], r["reward_mean"]) for r in records if r.get("reward_mean") is not None]
    evals = [(r["step"], r["eval_accuracy"]) for r in records if r.get("eval_accuracy") is not None]
    if not train and not evals:
        raise ValueError(f"{run_dir}/metrics.jsonl has no reward_mean or eval_accuracy records")
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), marker=".", label="rollout reward (mean)")
    if evals:
        ax.plot(*zip(*evals, strict=True), marker="o", label="held-out accuracy (greedy)")
    domains = sorted({k.removeprefix("domain_").removesuffix("_reward_mean") for r in records
                      for k in r if k.startswith("domain_") and k.endswith("_reward_mean")})
    for d in domains:  # [[domains]] runs: each domain's own curves, dashed
        for key, label in (("reward_mean", "reward"), ("eval_accuracy", "held-out")):
            pts = [(r["step"], r[f"domain_{d}_{key}"]) for r in records
                   if isinstance(r.get(f"domain_{d}_{key}"), (int, float))]
            if pts:
                ax.plot(*zip(*pts, strict=True), ls="--", lw=1, label=f"{d}: {label}")
    ax.set_xlabel("optimizer step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(run_dir.name)
    out = Path(out) if out else run_dir / "curves.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
