"""Build the model families' real chat templates and tokenizers into `.cache/families/<family>/`.

Source: the PyPI sdist `llama-cpp-python==0.3.36` (pinned below), whose
`vendor/llama.cpp/models/` ships the families' own HF chat templates (`templates/*.jinja`) and
vocab-only GGUF files (`ggml-vocab-*.gguf`) with the original tokenizers, each with `.inp`/`.out`
test strings and the ids the original HF tokenizer gives. Each family folder holds a HF tokenizer
(`save_pretrained`: tokenizer.json, tokenizer_config.json with the chat template),
`generation_config.json` (the family's published eos ids) and `family.json`: template and vocab
file, "real" or "stand-in" vocab, bos/eos, generation eos ids and their source, and the
.inp/.out verification result (a family whose converted tokenizer disagrees with the .out ids
fails the build).

Known gaps, handled here and recorded in family.json:
- the qwen2 GGUF names Qwen's added tokens `[PAD151646]`...: their names are overlaid from the
  families' published tokenizer_config.json (`OVERLAY`), with the published `special` flag
  (Qwen's `<tool_call>`/`<think>` are added tokens that are not special);
- Llama 3's GGUF (llama-bpe) predates 3.1, whose `<|eom_id|>` (128008), `<|python_tag|>`
  (128010) and `<|finetune_right_pad_id|>` (128004) are overlaid the same way;
- no Mistral (tekken), GLM or Kimi vocab is shipped: their templates are paired with a stand-in
  vocab plus the family's control tokens added as special tokens ("vocab": "stand-in").

Usage: `python scripts/families.py [--out DIR] [--sdist DIR] [family ...]`; idempotent: a family
whose family.json matches this script's hash is kept (scripts/setup.sh calls it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
MODELS = "vendor/llama.cpp/models/"
ROOT = Path(__file__).resolve().parent.parent

QWEN_ADDED = {  # Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen3-0.6B tokenizer_config.json
    151646: ("<|object_ref_start|>", True), 151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True), 151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True), 151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True), 151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True), 151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True), 151657: ("<tool_call>", False),
    151658: ("</tool_call>", False), 151659: ("<|fim_prefix|>", False),
    151660: ("<|fim_middle|>", False), 151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False), 151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False)}
QWEN3_ADDED = {**QWEN_ADDED, 151665: ("<tool_response>", False),
               151666: ("</tool_response>", False), 151667: ("<think>", False),
               151668: ("</think>", False)}
R1_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"  # DeepSeek writes fullwidth bars, U+2581
R1_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
R1_QWEN_ADDED = {  # deepseek-ai/DeepSeek-R1-Distill-Qwen-32B tokenizer.json added_tokens
    151643: (R1_EOS, True), 151644: ("<\uff5cUser\uff5c>", False),
    151645: ("<\uff5cAssistant\uff5c>", False), 151646: (R1_BOS, True),
    151647: ("<|EOT|>", False), 151648: ("<think>", False), 151649: ("</think>", False)}
LLAMA31_ADDED = {  # meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json
    128004: ("<|finetune_right_pad_id|>", True), 128008: ("<|eom_id|>", True),
    128010: ("<|python_tag|>", True)}

FAMILIES: dict[str, dict] = {
    "qwen2.5": dict(
        template="Qwen-Qwen2.5-7B-Instruct.jinja", vocab="qwen2", overlay=QWEN_ADDED,
        bos=None, eos="<|im_end|>", generation_eos=["<|im_end|>", "<|endoftext|>"],
        published_ids=[151645, 151643],
        generation_source="Qwen/Qwen2.5-7B-Instruct generation_config.json: [151645, 151643]"),
    "qwen3": dict(
        template="Qwen-Qwen3-0.6B.jinja", vocab="qwen2", overlay=QWEN3_ADDED,
        bos=None, eos="<|im_end|>", generation_eos=["<|im_end|>", "<|endoftext|>"],
        published_ids=[151645, 151643],
        generation_source="Qwen/Qwen3-0.6B generation_config.json: [151645, 151643]"),
    "llama3.1": dict(
        template="meta-llama-Llama-3.1-8B-Instruct.jinja", vocab="llama-bpe",
        overlay=LLAMA31_ADDED, ignore_merges=True, bos="<|begin_of_text|>", eos="<|eot_id|>",
        generation_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        published_ids=[128001, 128008, 128009],
        generation_source="meta-llama/Llama-3.1-8B-Instruct generation_config.json: "
                          "[128001, 128008, 128009]"),
    "phi3.5": dict(
        template="microsoft-Phi-3.5-mini-instruct.jinja", vocab="phi-3", bos="<s>",
        eos="<|endoftext|>", generation_eos=["<|end|>", "<|assistant|>", "<|endoftext|>"],
        published_ids=[32007, 32001, 32000],
        generation_source="microsoft/Phi-3.5-mini-instruct generation_config.json: "
                          "[32007, 32001, 32000]"),
    "gemma4": dict(
        template="google-gemma-4-31B-it.jinja", vocab="gemma-4", arch="gemma3", bos="<bos>",
        eos="<eos>", generation_eos=["<eos>", "<turn|>"],
        published_ids=[1, 106],
        generation_source="google/gemma-4 config.json / generation_config.json: [1, 106]"),
    "deepseek-r1-qwen": dict(
        template="deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", vocab="qwen2",
        overlay={**QWEN_ADDED, **R1_QWEN_ADDED}, bos=R1_BOS,
        eos=R1_EOS, generation_eos=[R1_EOS],
        published_ids=[151643],
        generation_source="deepseek-ai/DeepSeek-R1-Distill-Qwen-32B generation_config.json: "
                          "151643"),
    "mistral-nemo": dict(
        template="mistralai-Mistral-Nemo-Instruct-2407.jinja", vocab="phi-3",
        stand_in=["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"],
        bos="<s>", eos="</s>", generation_eos=["</s>"],
        generation_source="mistralai/Mistral-Nemo-Instruct-2407 generation_config.json: 2 "
                          "(</s>; stand-in ids)"),
    "glm4.6": dict(
        template="GLM-4.6.jinja", vocab="qwen2",
        stand_in=["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>",
                  "</tool_response>", "<|endoftext|>"],
        bos=None, eos="<|endoftext|>",
        generation_eos=["<|endoftext|>", "<|user|>", "<|observation|>"],
        generation_source="zai-org/GLM-4.6 generation_config.json: [151329, 151336, 151338] "
                          "(stand-in ids)"),
    "kimi-k2": dict(
        template="moonshotai-Kimi-K2.jinja", vocab="qwen2",
        stand_in=["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                  "<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                  "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                  "[EOS]"],
        bos=None, eos="[EOS]", generation_eos=["<|im_end|>"],
        generation_source="moonshotai/Kimi-K2-Instruct generation_config.json: 163586 "
                          "(<|im_end|>; stand-in ids)"),
}
"""family -> template file, vocab GGUF (`ggml-vocab-<vocab>.gguf`), overlay {id: (name,
special)}, stand_in (control tokens added to a stand-in vocab), bos/eos token, the generation
config's eos tokens and where they come from."""


def script_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def fetch_sdist(cache: Path) -> Path:
    """The extracted sdist's `models/` folder under `cache` (pip download once, then reused)."""
    name = SDIST.replace("==", "-").replace("-", "_", 2)  # llama_cpp_python-0.3.36
    models = cache / name / MODELS
    if (models / "templates").is_dir():
        return models
    tarball = cache / f"{name}.tar.gz"
    if not tarball.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", SDIST, "-d", str(cache)], check=True)
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers() if f"/{MODELS}" in m.name and m.isfile()]
        tar.extractall(cache, members=members, filter="data")
    return models


def read_tests(gguf: Path) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs of a GGUF vocab's `.inp`/`.out` files ([] when absent)."""
    inp, out = Path(f"{gguf}.inp"), Path(f"{gguf}.out")
    if not (inp.exists() and out.exists()):
        return []
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts and texts[-1].endswith("\n__ggml_vocab_test__"):
        texts[-1] = texts[-1][: -len("\n__ggml_vocab_test__")]
    rows = out.read_text(encoding="utf-8").split("\n")
    return [(t, [int(x) for x in r.split()]) for t, r in zip(texts, rows, strict=False)]


def overlay_tokens(fast, overlay: dict):
    """`fast` (a `tokenizers.Tokenizer`) with the ids of `overlay` renamed {id: (name, special)}
    as added tokens (the name is written as is, not in a byte-level alphabet)."""
    from tokenizers import Tokenizer  # lazy: the script's own dependencies load per run

    data = json.loads(fast.to_str())
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    kept = [a for a in data["added_tokens"] if a["id"] not in overlay]
    for i, (name, special) in overlay.items():
        vocab.pop(by_id.get(i), None)
        vocab[name] = i
        kept.append({"id": i, "content": name, "single_word": False, "lstrip": False,
                     "rstrip": False, "normalized": False, "special": special})
    data["added_tokens"] = sorted(kept, key=lambda a: a["id"])
    return Tokenizer.from_str(json.dumps(data))


def convert(gguf: Path, spec: dict):
    """A `PreTrainedTokenizerFast` of a vocab GGUF: `overlay` names applied, `stand_in` control
    tokens added as special tokens, `ignore_merges` set (a word in the vocabulary is one token
    whatever the merges: Llama 3's tokenizer.json sets it, the GGUF does not carry it)."""
    from tokenizers import AddedToken  # lazy: the script's own dependencies load per run
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    gguf_arch, tok, cfg = get_gguf_tokenizer(str(gguf))
    fast, _ = convert_gguf_tokenizer(spec.get("arch") or gguf_arch, tok)
    if spec.get("overlay"):
        fast = overlay_tokens(fast, spec["overlay"])
    if spec.get("ignore_merges"):
        fast.model.ignore_merges = True
    have = set(fast.get_vocab())
    fast.add_special_tokens([AddedToken(t, special=True, normalized=False)
                             for t in spec.get("stand_in", []) if t not in have])
    vocab = fast.get_vocab()
    specials = {k: cfg[k] for k in ("unk_token", "pad_token") if cfg.get(k) in vocab}
    specials |= {f"{k}_token": spec[k] for k in ("bos", "eos") if spec[k]}
    return PreTrainedTokenizerFast(tokenizer_object=fast, **specials)


def build(name: str, spec: dict, models: Path, out: Path) -> dict:
    """Build one family's folder; returns its family.json."""
    t0 = time.monotonic()
    gguf = models / f"ggml-vocab-{spec['vocab']}.gguf"
    tok = convert(gguf, spec)
    tests = read_tests(gguf)
    bad = [t for t, ids in tests if tok.encode(t, add_special_tokens=False) != ids]
    if bad:
        raise SystemExit(f"families: {name}: {len(bad)}/{len(tests)} .inp strings tokenize "
                         f"unlike the .out ids, first {bad[0]!r}")
    tok.add_bos_token = False  # the template writes BOS where the family has one
    tok.chat_template = (models / "templates" / spec["template"]).read_text(encoding="utf-8")
    eos_ids = [tok.convert_tokens_to_ids(t) for t in spec["generation_eos"]]
    if spec.get("published_ids", eos_ids) != eos_ids:
        raise SystemExit(f"families: {name}: eos {spec['generation_eos']} are ids {eos_ids} here, "
                         f"{spec['published_ids']} in the published generation config")
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    bos_id = tok.convert_tokens_to_ids(spec["bos"]) if spec["bos"] else None
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_ids}, indent=1))
    meta = {
        "family": name, "template": spec["template"], "vocab_file": gguf.name,
        "vocab": "stand-in" if spec.get("stand_in") else "real",
        "overlay": {str(i): n for i, (n, _) in spec.get("overlay", {}).items()},
        "stand_in_tokens": spec.get("stand_in", []), "bos": spec["bos"], "bos_id": bos_id,
        "eos": spec["eos"], "generation_eos": spec["generation_eos"],
        "generation_eos_ids": eos_ids, "generation_source": spec["generation_source"],
        "verified": f"{len(tests) - len(bad)}/{len(tests)} .inp strings tokenize to the .out ids",
        "source": f"PyPI {SDIST} {MODELS}", "builder": script_hash(),
        "build_s": round(time.monotonic() - t0, 1)}
    (folder / "family.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", help="default: all of " + ", ".join(FAMILIES))
    ap.add_argument("--out", type=Path, default=ROOT / ".cache" / "families")
    ap.add_argument("--sdist", type=Path, default=ROOT / ".cache" / "sdist")
    args = ap.parse_args(argv)
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        print(f"families: unknown {unknown}; known: {list(FAMILIES)}", file=sys.stderr)
        return 2
    todo, names = [], args.families or list(FAMILIES)
    for name in names:
        meta = args.out / name / "family.json"
        if not (meta.exists() and json.loads(meta.read_text()).get("builder") == script_hash()):
            todo.append(name)
    if not todo:
        print(f"families: {len(names)} up to date in {args.out}")
        return 0
    models = fetch_sdist(args.sdist)
    for name in todo:
        meta = build(name, FAMILIES[name], models, args.out)
        print(f"families: {name}: {meta['vocab']} vocab, {meta['verified']}, "
              f"{meta['build_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
