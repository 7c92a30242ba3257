"""Sampling parameters in the local engine: vLLM's transforms, sampled and recorded exactly.

Pinned here (CASES.md C04, C21), on hand-computed logits and on the tiny random Llama:
- C21: logits [2, 1, 0, -1] with tokens 0 and 3 in the context. With the explicit neutral
  params the recorded logprobs are log_softmax(logits) and the trainer/engine ratio is 1.0;
  repetition_penalty 1.1 (a model's generation_config default) records the penalised
  distribution [-0.505362, -1.323544, -2.323544, -3.423544], whose ratio against the trainer's
  full softmax is 1.067343 (token 0) and 0.889900 (token 1): why such turns are not trained.
- presence / frequency penalties count the completion only, the repetition penalty the prompt
  too (hand-computed); C04's top_p: probabilities [0.5, 0.3, 0.2] with top_p 0.79 keep tokens 0
  and 1, token 0 records log(0.5 / 0.8) = -0.470004 and token 2 is never drawn; top_k keeps
  ties with the k-th token; min_p is relative to the top token after temperature; greedy is the
  argmax of the penalised logits with T = 1 logprobs and no filter.
- one batch mixing every kind of row equals each row alone; draws follow the renormalised
  distribution and never hit a dropped token.
- the LocalEngine, generating with every parameter set (seeded, two rows in one batch),
  records for each token exactly the logprob of the transformed teacher-forced logits
  (context = prompt + completion so far); all its tokens lie in the kept support.
- `SamplingParams`: neutral defaults, `transforms()` names what is not neutral (top_k -1 is
  off), `check()` names a field out of range; a pool row written before these fields existed
  loads with the neutral values (a real SQLite file).
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3

import pytest
import torch

from forgerl.datapool.sqlite import SQLitePool
from forgerl.engines.local import LocalEngine
from forgerl.engines.local.sampler import sample_tokens, sampling_logprobs
from forgerl.types import Completion, SamplingParams

C21 = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
NEUTRAL = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                         presence_penalty=0.0, frequency_penalty=0.0)


def lp(logits, params: SamplingParams, prompt=(), done=()) -> list[float]:
    return sampling_logprobs(logits, [params], [(list(prompt), list(done))])[0].tolist()


def log_softmax(values: list[float]) -> list[float]:
    top = max(values)
    norm = top + math.log(sum(math.exp(v - top) for v in values))
    return [v - norm for v in values]


def test_c21_neutral_params_give_ratio_one_and_the_penalty_default_does_not():
    trainer = log_softmax([2.0, 1.0, 0.0, -1.0])  # what the trainer scores: full softmax, T = 1
    assert trainer == pytest.approx([-0.440190, -1.440190, -2.440190, -3.440190], abs=1e-6)
    neutral = lp(C21, NEUTRAL, prompt=[0, 3])
    assert neutral == pytest.approx(trainer, abs=1e-6)
    assert [math.exp(t - e) for t, e in zip(trainer, neutral, strict=True)] == pytest.approx(
        [1.0] * 4, abs=1e-6)
    penalised = lp(C21, SamplingParams(repetition_penalty=1.1), prompt=[0, 3])
    assert penalised == pytest.approx([-0.505362, -1.323544, -2.323544, -3.423544], abs=1e-6)
    ratios = [math.exp(t - e) for t, e in zip(trainer, penalised, strict=True)]
    assert ratios[:2] == pytest.approx([1.067343, 0.889900], abs=1e-6)
    # the same tokens in the completion instead of the prompt: the same repetition penalty
    assert lp(C21, SamplingParams(repetition_penalty=1.1), done=[3, 0]) == pytest.approx(
        penalised, abs=1e-6)


def test_presence_and_frequency_count_the_completion_only():
    params = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5)
    # token 0 twice and token 3 once in the completion, token 1 only in the prompt:
    # 2 - 2 * 0.5 - 0.25 = 0.75, 1 unchanged, 0 unchanged, -1 - 0.5 - 0.25 = -1.75
    got = lp(C21, params, prompt=[1], done=[0, 0, 3])
    assert got == pytest.approx(log_softmax([0.75, 1.0, 0.0, -1.75]), abs=1e-6)
    # with a repetition penalty of 2 first: token 1 (prompt) 1 / 2; token 0 2 / 2 - 1.25;
    # token 3 -1 * 2 - 0.75; then T = 0.5 doubles everything
    both = SamplingParams(0.5, repetition_penalty=2.0, presence_penalty=0.25,
                          frequency_penalty=0.5)
    expected = log_softmax([2 * (1.0 - 1.25), 2 * 0.5, 0.0, 2 * (-2.0 - 0.75)])
    assert lp(C21, both, prompt=[1], done=[0, 0, 3]) == pytest.approx(expected, abs=1e-6)


def test_c04_top_p_top_k_and_min_p_renormalise_over_the_kept_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    # top_p 0.79 (C04's 0.8 sits on the float boundary where 1 - p equals token 2's mass)
    got = lp(probs.log(), SamplingParams(top_p=0.79))
    assert got[:2] == pytest.approx([math.log(0.5 / 0.8), math.log(0.3 / 0.8)], abs=1e-6)
    assert got[0] == pytest.approx(-0.470004, abs=1e-6) and got[2] == -math.inf
    assert lp(probs.log(), NEUTRAL)[0] == pytest.approx(-0.693147, abs=1e-6)
    # top_k 2 over [2, 1, 1, 0]: the tie with the 2nd token stays
    got = lp(torch.tensor([[2.0, 1.0, 1.0, 0.0]]), SamplingParams(top_k=2))
    assert got[:3] == pytest.approx(log_softmax([2.0, 1.0, 1.0]), abs=1e-6)
    assert got[3] == -math.inf
    assert lp(C21, SamplingParams(top_k=4)) == lp(C21, SamplingParams(top_k=-1)) == lp(C21, NEUTRAL)
    # min_p 0.2 at T = 1: softmax [0.644, 0.237, 0.087, 0.032], threshold 0.129: keeps 0 and 1
    got = lp(C21, SamplingParams(min_p=0.2))
    assert got == pytest.approx([*log_softmax([2.0, 1.0]), -math.inf, -math.inf], abs=1e-6)
    # after T = 4 the probabilities flatten ([0.36, 0.28, 0.22, 0.17]): min_p 0.2 keeps all
    assert lp(C21, SamplingParams(4.0, min_p=0.2)) == pytest.approx(
        log_softmax([0.5, 0.25, 0.0, -0.25]), abs=1e-6)
    # all three with a penalty: penalties, T, min_p, top_k, top_p in this order
    params = SamplingParams(0.5, top_p=0.9, top_k=3, min_p=0.01, repetition_penalty=1.5)
    x = [2 / 1.5, 1.0, 0.0, -1.0]  # token 0 in the context
    z = [v / 0.5 for v in x]  # [2.667, 2, 0, -2]
    full = log_softmax(z[:3])  # top_k 3 drops token 3; top_p 0.9 then drops token 2
    assert math.exp(full[0]) + math.exp(full[1]) < 0.999 and math.exp(full[0]) < 0.9
    assert lp(C21, params, prompt=[0]) == pytest.approx(
        [*log_softmax(z[:2]), -math.inf, -math.inf], abs=1e-6)


def test_greedy_takes_the_penalised_argmax_with_t1_logprobs_and_no_filter():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    params = SamplingParams(0.0, top_k=1, top_p=0.1, min_p=0.9, repetition_penalty=1.1)
    tokens, lps = sample_tokens(logits, [params], [None], [([0], [])])
    assert int(tokens[0]) == 1  # 2 / 1.1 = 1.818 < 1.9
    assert float(lps[0]) == pytest.approx(log_softmax([2 / 1.1, 1.9, 0.0, -1.0])[1], abs=1e-6)


def test_mixed_batch_equals_each_row_alone_and_draws_avoid_dropped_tokens():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    rows = [NEUTRAL, SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.6, min_p=0.05),
            SamplingParams(0.0, repetition_penalty=1.2), SamplingParams(
                0.9, presence_penalty=0.5, frequency_penalty=-0.3, repetition_penalty=0.8)]
    contexts = [([1, 2], [3]), ([], [4]), ([5, 5], []), ([7, 8, 9], [10]), ([11], [12, 12, 13])]
    together = sampling_logprobs(logits, rows, contexts)
    for i, (p, ctx) in enumerate(zip(rows, contexts, strict=True)):
        assert torch.equal(together[i], sampling_logprobs(logits[i:i + 1], [p], [ctx])[0])
    assert torch.isinf(together[1]).sum() == 45 and torch.isinf(together[0]).sum() == 0
    # 4,000 draws of row 2 (top_p 0.6, min_p): only kept tokens, at their renormalised rates
    n, gen = 4000, torch.Generator().manual_seed(3)
    tokens, lps = sample_tokens(logits[2:3].repeat(n, 1), [rows[2]] * n, [gen] * n,
                                [contexts[2]] * n)
    kept = together[2].isfinite()
    assert kept[tokens].all() and lps.isfinite().all()
    freq = torch.bincount(tokens, minlength=50).double() / n
    assert torch.allclose(freq, together[2].double().exp(), atol=0.03)
    with pytest.raises(ValueError, match="context"):
        sampling_logprobs(logits[:1], [SamplingParams(frequency_penalty=1.0)])


def _transformed_teacher_forced(model, prompt, out, params) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]  # (C, V)
    return [sampling_logprobs(logits[t:t + 1], [params], [(prompt, out[:t])])[0, tok].item()
            for t, tok in enumerate(out)]


def test_local_engine_records_the_transformed_distribution(tiny_model):
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22]]
    params = [SamplingParams(0.8, max_tokens=24, seed=1, top_p=0.95, top_k=40, min_p=0.02,
                             repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.3),
              SamplingParams(1.2, max_tokens=24, seed=2, repetition_penalty=0.9, top_k=100)]

    async def main():
        engine = LocalEngine(tiny_model, max_model_len=128, max_batch_size=4)
        try:
            return await asyncio.gather(*(engine.generate(p, s)
                                          for p, s in zip(prompts, params, strict=True)))
        finally:
            await engine.close()

    outs = asyncio.run(main())
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert len(out.completion_ids) == 24 and all(math.isfinite(x) for x in out.logprobs)
        expected = _transformed_teacher_forced(tiny_model, prompt, out.completion_ids, p)
        assert out.logprobs == pytest.approx(expected, abs=1e-4)
        plain = _transformed_teacher_forced(tiny_model, prompt, out.completion_ids,
                                            SamplingParams(p.temperature))
        assert max(abs(a - b) for a, b in zip(plain, out.logprobs, strict=True)) > 0.01


def test_sampling_params_neutral_transforms_and_check():
    assert SamplingParams() == NEUTRAL and NEUTRAL.transforms() == ()
    assert SamplingParams(top_k=-1).transforms() == ()
    assert SamplingParams(0.0, top_p=0.9).transforms() == ("top_p",)
    assert SamplingParams(top_k=20, repetition_penalty=1.1).transforms() == (
        "top_k", "repetition_penalty")
    assert SamplingParams(min_p=0.1, presence_penalty=-1, frequency_penalty=2).transforms() == (
        "min_p", "presence_penalty", "frequency_penalty")
    NEUTRAL.check()
    for bad, field in [(dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
                       (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0),
                                                    "repetition_penalty"),
                       (dict(presence_penalty=2.5), "presence_penalty"),
                       (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                       (dict(temperature=-0.1), "temperature"), (dict(max_tokens=0), "max_tokens")]:
        with pytest.raises(ValueError, match=f"^{field} "):
            SamplingParams(**bad).check()


def test_old_pool_rows_load_with_neutral_params(tmp_path):
    path = tmp_path / "pool.sqlite"
    pool = SQLitePool(path)
    tid = pool.create_trajectory(0, 0)
    done = SamplingParams(0.7, top_k=20, repetition_penalty=1.1, max_tokens=8, seed=3)
    pool.add_completion(tid, Completion([1, 2], [3], [-0.5], [0], 0, "stop", sampling=done))
    pool.add_completion(tid, Completion([1, 2, 3], [4], [-0.25], [0], 0, "stop",
                                           sampling=SamplingParams(0.7, top_p=0.9)))
    pool.close()
    old = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "stop_token_ids": [2],
           "seed": None}  # the JSON written before top_k, min_p and the penalties existed
    with sqlite3.connect(path) as db:
        db.execute("UPDATE completions SET sampling = ? WHERE turn = 1", (json.dumps(old),))
    pool = SQLitePool(path)
    try:
        first, second = pool.get_trajectory(tid).completions
    finally:
        pool.close()
    assert first.sampling == done
    assert second.sampling == SamplingParams(0.7, top_p=0.9, max_tokens=64, stop_token_ids=(2,))
    assert second.sampling.transforms() == ("top_p",)

