"""The local engine's decode step: continuous batching over the KV batch with prefix reuse.

Data flow: the worker thread (`LocalEngine._run`) calls `_step` while rows run or wait; each
step decodes one token for every running row, then admits waiting requests up to
`max_batch_size`, prefills them (in waves that share prefixes through the prefix cache) and
merges them into the running batch. Rows that finished or whose consumer left are resolved and
dropped at once.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from forgerl.cpu_share import CpuShare
from forgerl.engines.kv_pool import KVPool, fetch, publish
from forgerl.engines.local.adapters import EngineAdapters
from forgerl.engines.local.kv_batch import _Batch, _fail, _KVCache, _Request
from forgerl.engines.local.prefix_cache import KV, PrefixCache, common_prefix
from forgerl.engines.local.routes import RouteRecorder, joined
from forgerl.engines.local.sampler import sample_tokens
from forgerl.engines.local.speculative import SpeculativeDecoder

WAVE_MIN_SHARED = 16  # a newcomer waits one wave when a sibling offers this many more tokens


class ContinuousBatcher(SpeculativeDecoder, EngineAdapters):
    """The decode loop's state and step, the base of `LocalEngine` (which sets every attribute
    below in its constructor and runs `_step` on its worker thread)."""

    model: torch.nn.Module
    device: torch.device
    max_batch_size: int
    weight_version: int
    cpu_share: CpuShare | None
    prefix_cache: PrefixCache
    recorder: RouteRecorder | None
    kv_pool: KVPool | None
    stats: dict
    _waiting: deque[_Request]
    _batch: _Batch | None

    @torch.inference_mode()
    def _step(self) -> None:
        """Decode one token for running rows, then prefill and merge admitted newcomers.

        A forward that raises fails the rows it ran (the running batch, or only the newcomers
        of a failed prefill), never the engine.
        """
        if self._batch is not None:
            start = time.perf_counter()
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += len(self._batch.rows)
            try:
                with self.adapters_of(self._batch.rows):
                    self._batch = self._finish(self._decode(self._batch))
            except Exception as exc:
                rows, self._batch = self._batch.rows, None
                _fail(rows, exc)
            self.collect()
            self.stats["decode_seconds"] += time.perf_counter() - start
        free = self.max_batch_size - (len(self._batch.rows) if self._batch else 0)
        newcomers = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        self.stats["queued_peak"] = max(self.stats["queued_peak"], len(self._waiting))
        newcomers = [r for r in newcomers  # skip consumers that left; stamp adapter versions
                     if not r.cancelled and self.stamp(r)]
        if not newcomers:
            return
        start = time.perf_counter()
        if self.cpu_share is not None:  # never a team on all cores (cpu_share.py); the next
            torch.set_num_threads(self.cpu_share.threads("prefill"))  # step's enter resets it
        try:
            fresh = self._finish(self._prefill(newcomers))
        except Exception as exc:
            _fail(newcomers, exc)
            return
        finally:
            self.stats["prefill_seconds"] += time.perf_counter() - start
        if self._batch is None:
            self._batch = fresh
            return
        if fresh is None:  # every newcomer finished at its first token
            return
        try:
            self._batch.merge(fresh)
        except Exception as exc:  # e.g. out of memory: the running batch may be half-merged
            rows, self._batch = self._batch.rows + fresh.rows, None
            _fail(rows, exc)

    def _decode(self, batch: _Batch) -> _Batch:
        """Feed each row's pending token through the cache; sample the next one (or run a
        speculative step of drafts, `speculative.py`)."""
        if k := self.spec_ready(batch):
            return self.spec_decode(batch, k)
        ones = batch.mask.new_ones(len(batch.rows), 1)
        batch.mask = torch.cat([batch.mask, ones], dim=1)  # (B, L + 1)
        if self.recorder:
            self.recorder.start()
        out = self.model(
            input_ids=batch.next_ids.unsqueeze(1),
            attention_mask=batch.mask,
            position_ids=batch.positions.unsqueeze(1),
            cache=batch.cache,
            use_cache=True,
        )
        if self.recorder:
            self.recorder.decoded(batch.rows)
        batch.positions = batch.positions + 1
        self.note_hidden(batch.rows)
        batch.next_ids = self._sample(batch.rows, out.logits[:, -1])
        return batch

    def _prefill(self, rows: list[_Request]) -> _Batch:
        """Prefill `rows` in waves (see `_next_wave`) and merge them into one batch."""
        batch, pending = None, rows
        while pending:
            wave, pending = self._next_wave(pending)
            fresh = self._prefill_wave(wave)
            if batch is None:
                batch = fresh
            else:
                batch.merge(fresh)
        assert batch is not None
        return batch

    def _next_wave(self, rows: list[_Request]) -> tuple[list[_Request], list[_Request]]:
        """Split rows into (this wave, later): a row waits when an earlier row of this wave
        shares WAVE_MIN_SHARED more prompt tokens with it than the cache does, so a group's
        shared system prompt is prefilled once and then reused from the cache."""
        if not self.prefix_cache.max_tokens:
            return rows, []
        wave: list[tuple[object, tuple[int, ...]]] = []
        now, later = [], []
        for req in rows:
            seq = tuple(req.prompt_ids + req.completion_ids)
            hit = self.prefix_cache.longest(seq, req.ns)[0]
            sibling = min(max((common_prefix(seq, w) for ns, w in wave if ns == req.ns),
                              default=0), len(seq) - 1)
            if sibling >= hit + WAVE_MIN_SHARED:
                later.append(req)
            else:
                now.append(req)
                wave.append((req.ns, seq))
        return now, later

    def _prefill_wave(self, rows: list[_Request]) -> _Batch:
        """Prefill each row's prompt + completion so far, reusing cached KV for its longest
        cached prefix; sample a token. Row i's cache columns are [pad, n_i reused, pad, new].

        When the cache holds every row's sequence but its last token (a group's later waves),
        no forward runs: the rows get their cached KV and that token as pending, and the next
        decode step computes its logits and samples (one forward per step instead of two)."""
        seqs = [tuple(r.prompt_ids + r.completion_ids) for r in rows]
        hits = [self._lookup(s, r.ns) for s, r in zip(seqs, rows, strict=True)]
        past = max(n for n, _ in hits)
        reused = sum(n for n, _ in hits)
        self.stats["prefill_tokens"] += sum(len(s) for s in seqs) - reused
        self.stats["prefix_hits"] += sum(n > 0 for n, _ in hits)
        self.stats["prefix_hit_tokens"] += reused
        if self.recorder:
            self.recorder.reused(rows, hits, self.prefix_cache)
            self.recorder.start()
        if all(0 < n == len(s) - 1 for s, (n, _) in zip(seqs, hits, strict=True)):
            mask = torch.zeros(len(rows), past, dtype=torch.long, device=self.device)
            for i, (n, _) in enumerate(hits):
                mask[i, past - n :] = 1
            pending = torch.tensor([s[-1] for s in seqs], device=self.device)
            for r in rows:  # no forward: no hidden state to draft from until the next one
                r.draft_hidden = None
            return _Batch(rows, _KVCache(self._stack_past(hits, past)), mask, mask.sum(1), pending)
        new = max(len(s) - n for s, (n, _) in zip(seqs, hits, strict=True))
        ids = torch.zeros(len(rows), new, dtype=torch.long, device=self.device)  # (B, S)
        positions = torch.zeros_like(ids)
        mask = torch.zeros(len(rows), past + new, dtype=torch.long, device=self.device)
        for i, (seq, (n, _)) in enumerate(zip(seqs, hits, strict=True)):
            m = len(seq) - n
            ids[i, new - m :] = torch.tensor(seq[n:], dtype=torch.long)
            positions[i, new - m :] = torch.arange(n, len(seq))
            mask[i, past - n : past] = 1
            mask[i, past + new - m :] = 1
        cache = _KVCache(self._stack_past(hits, past) if past else None)
        with self.adapters_of(rows):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             cache=cache, use_cache=True, logits_to_keep=1)
        if self.recorder:
            self.recorder.prefilled(rows, [len(s) - n for s, (n, _) in zip(seqs, hits,
                                                                         strict=True)], ids.shape)
        self.note_hidden(rows)
        batch = _Batch(rows, cache, mask, mask.sum(dim=1), self._sample(rows, out.logits[:, -1]))
        for i, seq in enumerate(seqs):
            self._keep(seq, batch, i)
        return batch

    def _lookup(self, seq: tuple[int, ...], ns: object = None) -> tuple[int, KV | None]:
        """The prefix cache's longest hit in namespace `ns` (a LoRA adapter version, None for
        the base), or the KV pool's prefix when it is longer (the base only)."""
        n, kv = self.prefix_cache.lookup(seq, ns)
        if self.kv_pool is not None and ns is None:
            m, pooled = fetch(self.kv_pool, self.weight_version, seq, n)
            if pooled is not None:
                self.stats["pool_hits"] += 1
                self.stats["pool_hit_tokens"] += m - n
                return m, pooled
        return n, kv

    def _keep(self, seq: tuple[int, ...], batch: _Batch, i: int) -> None:
        """Insert row i's KV for `seq` (and a MoE row's routes) into the prefix cache and
        publish the KV to the KV pool; nothing is copied out when both are off."""
        if not self.prefix_cache.max_tokens and self.kv_pool is None:
            return
        ns = batch.rows[i].ns
        if ns is not None and self.adapter_versions.get(ns[0]) != ns[1]:
            return  # an adapter version that no newcomer gets any more
        kv = batch.row_kv(i)
        if self.prefix_cache.max_tokens:
            self.prefix_cache.insert(seq, kv, self._routes(batch.rows[i]), ns)
        if self.kv_pool is not None and ns is None:
            publish(self.kv_pool, self.weight_version, seq, kv)

    @staticmethod
    def _stack_past(hits: list[tuple[int, KV | None]], past: int) -> KV:
        """Left-pad each row's reused KV to `past` columns: per layer (B, H, past, D)."""
        template = next(kv for _, kv in hits if kv is not None)
        stacked = []
        for layer, (k0, _) in enumerate(template):
            keys = k0.new_zeros(len(hits), k0.shape[0], past, k0.shape[2])
            values = torch.zeros_like(keys)
            for i, (n, kv) in enumerate(hits):
                if kv is not None:
                    keys[i, :, past - n :], values[i, :, past - n :] = kv[layer]
            stacked.append((keys, values))
        return stacked

    def _sample(self, rows: list[_Request], logits: torch.Tensor) -> torch.Tensor:
        """Sample per row (its own params, context and generator) and record the tokens."""
        tokens, logprobs = sample_tokens(logits, [r.params for r in rows],
                                         [r.generator for r in rows],
                                         [(r.prompt_ids, r.completion_ids) for r in rows])
        now = time.perf_counter()
        for req, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            req.record(tok, lp, self.weight_version, now)
        # Release the GIL so the woken event loop delivers these tokens now, not when this
        # thread next blocks or is forced off after sys.getswitchinterval() (5 ms).
        time.sleep(0)
        return tokens

    @staticmethod
    def _routes(req: _Request) -> torch.Tensor | None:
        """A MoE row's routes of every token it fed, for the prefix cache; None if dense."""
        return joined(req.routes) if req.routes else None

    def _finish(self, batch: _Batch) -> _Batch | None:
        """Resolve finished (or cancelled) rows and drop them; None when no row is left.

        A finished row's KV (prompt + completion but the last token) goes to the prefix cache.
        """
        keep = []
        for i, req in enumerate(batch.rows):
            if req.finish_reason is not None:
                self._keep(tuple(req.prompt_ids + req.completion_ids[:-1]), batch, i)
                req.resolve()
            elif not req.cancelled:
                keep.append(i)
        if not keep:
            return None
        if len(keep) < len(batch.rows):
            batch.select(keep)
        return batch
