"""Routing decisions over several rollout-engine instances, without I/O (pure; `router.Router`
does the I/O).

Data flow: `Router.generate` / `stream` (router.py) describes every instance as an
`InstanceLoad` (routable or not, requests in flight, decode tokens they still owe, prompt tokens
it is estimated to hold, measured token rates, load bound) from its `RouterState`, and asks a
policy (`POLICIES`), a pure function of those loads, for an index: `round_robin`, `affinity`,
`cost_aware` (router.py's docstring says what each does). What each instance holds is the
router's own estimate, a `PrefixIndex` (a trie of chained `BLOCK`-token block hashes,
`block_hashes` of forgerl/engines/blocks.py, LRU-bounded per instance; one more for a global KV
pool); a request's prompt is recorded when it is sent
(`Flight`), its prompt + completion when it finishes. `RouterState` keeps this bookkeeping and
the measured costs on a clock the caller passes, so benchmarks/router.py runs the same code in a
simulation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from forgerl.engines.blocks import BLOCK, block_hashes

AFFINITY_MIN_MATCH = 0.5  # affinity follows a cached prefix covering at least this prompt share
PRIOR_PREFILL_TOK_S, PRIOR_STEP_S = 2000.0, 0.01  # until measured: tokens/s, s per decode step
EWMA = 0.2  # weight of a new rate sample
FIT_DECAY = 0.05  # weight of a new sample in the step-time line's least-squares sums


class PrefixIndex:
    """Which token prefixes each of n instances was sent: block-hash trie nodes → holders.

    capacity_blocks bounds each instance's record (least recently used nodes go first; a prefix's
    deeper blocks are older than its root, so eviction cuts chains from the leaves).
    """

    def __init__(self, n: int, capacity_blocks: int) -> None:
        self.n, self.capacity = n, capacity_blocks
        self.holders: dict[int, set[int]] = {}
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]

    def matched(self, hashes: Sequence[int]) -> list[int]:
        """Per instance, tokens of the longest recorded prefix among `hashes` (BLOCK * blocks)."""
        depth, alive = [0] * self.n, set(range(self.n))
        for k, h in enumerate(hashes):
            held = alive & self.holders.get(h, set())
            for i in alive - held:
                depth[i] = k
            alive = held
            if not alive:
                break
        for i in alive:
            depth[i] = len(hashes)
        return [d * BLOCK for d in depth]

    def add(self, i: int, hashes: Sequence[int]) -> None:
        """Record that instance i holds every prefix in `hashes` (most recently used)."""
        lru = self.lru[i]
        for h in reversed(hashes):  # the root ends most recent: evicted last
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self.holders.setdefault(h, set()).add(i)
        while len(lru) > self.capacity:
            self._drop(i, lru.popitem(last=False)[0])

    def forget(self, i: int) -> None:
        """Drop instance i's whole record (its cache was cleared)."""
        for h in list(self.lru[i]):
            self._drop(i, h)
        self.lru[i].clear()

    def _drop(self, i: int, h: int) -> None:
        held = self.holders[h]
        held.discard(i)
        if not held:
            del self.holders[h]


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What a policy sees of one instance for one request.

    healthy: routable (not failed, weights at the router's weight_version). in_flight: requests
    sent and not finished. cached_tokens: prompt tokens of this request it is estimated to hold.
    prefill_tok_s: measured prefill rate (tokens/s). step_s, row_s: the measured decode step time
    t(B) = step_s + row_s · B (seconds, B rows in the batch). expected_tokens: the completion
    length expected of this request (tokens). overlap_tokens: Σ over the requests in flight of
    min(tokens still owed, expected_tokens), the rows this request will share its steps with,
    summed over those steps. load_bound: most requests in flight that cost_aware allows it.
    pooled_tokens: prompt tokens the global KV pool is estimated to hold (0 without a pool);
    fetch_s_per_token: the measured seconds to fetch one token's KV from it.
    """

    healthy: bool
    in_flight: int
    cached_tokens: int
    prefill_tok_s: float
    step_s: float
    row_s: float
    expected_tokens: float
    overlap_tokens: float
    load_bound: int
    pooled_tokens: int = 0
    fetch_s_per_token: float = 0.0


Policy = Callable[[Sequence[InstanceLoad], int, int], int | None]


def round_robin(loads: Sequence[InstanceLoad], prompt_len: int, turn: int) -> int | None:
    """The first healthy instance at or after `turn` mod n (turn: the router's request counter);
    None when none is healthy."""
    n = len(loads)
    return next((j % n for j in range(turn, turn + n) if loads[j % n].healthy), None)


def affinity(loads: Sequence[InstanceLoad], prompt_len: int, turn: int) -> int | None:
    """The healthy instance with the most cached prompt tokens (ties: fewest in flight) when it
    holds at least AFFINITY_MIN_MATCH · prompt_len of them, else the healthy one with the fewest
    requests in flight (ties: lowest index). Ignores load bounds. None when none is healthy."""
    healthy = [i for i, x in enumerate(loads) if x.healthy]
    if not healthy:
        return None
    best = max(healthy, key=lambda i: (loads[i].cached_tokens, -loads[i].in_flight, -i))
    held = loads[best].cached_tokens
    if held > 0 and held >= AFFINITY_MIN_MATCH * prompt_len:
        return best
    return min(healthy, key=lambda i: (loads[i].in_flight, i))


def estimated_seconds(load: InstanceLoad, prompt_len: int) -> float:
    """Forge §3.3 cost of sending a prompt of prompt_len tokens to an instance, in seconds of
    request time summed over the new request and those in flight there:

        p = (prompt_len - cached_tokens) / prefill_tok_s          its uncached prefill
        cost = p · (1 + in_flight)                                 it stalls every running row
             + L · step_s + row_s · (L + 2 · overlap_tokens)       its L decode steps at t(B),
                                                                   and its row in theirs

    L = expected_tokens. The decode terms differ between instances only by row_s · overlap (the
    marginal slowdown of sharing steps, counted once for it and once for the others), so a
    cached prefix is worth a proportionally larger imbalance when steps are nearly flat in B.
    With a KV pool holding more of the prompt than the instance (pooled_tokens), p is the
    cheaper of recomputing the difference and fetching it:
    (pooled - cached) · fetch_s_per_token + (prompt_len - pooled) / prefill_tok_s."""
    uncached = max(prompt_len - load.cached_tokens, 0)
    prefill = uncached / load.prefill_tok_s
    if load.pooled_tokens > load.cached_tokens:  # the third option: fetch the pooled prefix
        fetched = (load.pooled_tokens - load.cached_tokens) * load.fetch_s_per_token
        rest = max(prompt_len - load.pooled_tokens, 0) / load.prefill_tok_s
        prefill = min(prefill, fetched + rest)
    prefill *= 1 + load.in_flight
    big_l = load.expected_tokens
    return prefill + big_l * load.step_s + load.row_s * (big_l + 2 * load.overlap_tokens)


def cost_aware(loads: Sequence[InstanceLoad], prompt_len: int, turn: int) -> int | None:
    """The healthy instance below its load bound with the least `estimated_seconds` (ties: lowest
    index); None when none qualifies (the router then waits for a free slot)."""
    ok = [i for i, x in enumerate(loads) if x.healthy and x.in_flight < x.load_bound]
    return min(ok, key=lambda i: (estimated_seconds(loads[i], prompt_len), i), default=None)


def dfs_order(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Indices of `prompts` in the depth-first order of their prefix trie (lexicographic order
    of the token ids; ties keep their order): prompts sharing a prefix become consecutive."""
    return sorted(range(len(prompts)), key=lambda k: tuple(prompts[k]))


POLICIES: dict[str, Policy] = {p.__name__: p for p in (round_robin, affinity, cost_aware)}


@dataclass(eq=False)  # identity: two flights with equal fields are still two
class Flight:
    """One request routed to `instance` (times in the RouterState's clock, seconds)."""

    instance: int
    prompt_ids: list[int]
    max_tokens: int
    uncached: int
    sent_at: float
    first_at: float | None = None
    produced: int = 0
    batch_sum: int = 0  # Σ over its tokens after the first of the instance's flights then


@dataclass
class RouterState:
    """The router's bookkeeping without I/O: prefixes sent, flights, measured costs, counters.

    Per instance: prefill rate (tokens/s, EWMA) = uncached prompt tokens / time to first token
    (from requests with at least BLOCK uncached tokens); the step-time line t(B) = a + b·B by
    exponentially weighted least squares (FIT_DECAY) over finished requests, each one sample
    (B = its mean number of flights on the instance while it decoded, t = its seconds per token
    after the first). While the samples' B spread less than one row the line is taken through
    half their mean time: a = b·B̄ (half fixed, half per row). Before a sample: the mean over the
    measured instances, else PRIOR_PREFILL_TOK_S and a = PRIOR_STEP_S, b = a / load_bound.
    Expected completion L = EWMA of finished completion lengths (the request's max_tokens before
    one), capped by its max_tokens; owed tokens per flight = max(min(max_tokens, L) - produced, 0).
    With a global KV pool (pool_blocks > 0, its capacity in blocks), `pool` records the prompts
    prefilled (at their first token) and the sequences finished on any instance (every instance
    publishes its KV there after a prefill and when a row finishes), and
    fetch_s_per_token (the pool's measured cost, set by the caller) prices fetching them.
    """

    n: int
    policy: Policy
    cache_tokens: int = 32768
    load_bound: int = 16
    pool_blocks: int = 0
    fetch_s_per_token: float = 0.0
    version: int = 0
    mean_completion: float | None = None
    turn: int = 0
    counters: dict[str, int | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.n
        self.index = PrefixIndex(n, self.cache_tokens // BLOCK)
        self.pool = PrefixIndex(1, self.pool_blocks) if self.pool_blocks else None
        self.flights: list[list[Flight]] = [[] for _ in range(n)]
        self.healthy, self.versions = [True] * n, [0] * n
        self.prefill_tok_s: list[float | None] = [None] * n
        self.fits: list[list[float] | None] = [None] * n  # EW sums w, Σx, Σy, Σxx, Σxy
        for i in range(self.n):
            for key in ("requests", "prompt_tokens", "cache_hit_tokens", "pool_fetch_tokens",
                        "queue_peak"):
                self.counters[f"instance{i}_{key}"] = 0

    def routable(self, i: int) -> bool:
        """Healthy and serving the router's weight version."""
        return self.healthy[i] and self.versions[i] == self.version

    def loads(self, prompt_ids: Sequence[int], hashes: Sequence[int],
              max_tokens: int | None = None) -> list[InstanceLoad]:
        """Every instance's InstanceLoad for this prompt (max_tokens caps its expected length)."""
        cached = self.index.matched(hashes)
        pooled = min(self.pool.matched(hashes)[0], len(prompt_ids) - 1) if self.pool else 0
        big_l = min(self.mean_completion or max_tokens or 256, max_tokens or 1 << 30)
        out = []
        for i in range(self.n):
            a, b = self.step_line(i)
            overlap = sum(max(min(f.max_tokens, big_l) - f.produced, 0) for f in self.flights[i])
            out.append(InstanceLoad(
                self.routable(i), len(self.flights[i]), min(cached[i], len(prompt_ids) - 1),
                self._rate(self.prefill_tok_s, i, PRIOR_PREFILL_TOK_S), a, b, big_l, overlap,
                self.load_bound, pooled, self.fetch_s_per_token))
        return out

    def step_line(self, i: int) -> tuple[float, float]:
        """(a, b) of instance i's decode step time t(B) = a + b·B, seconds (class docstring)."""
        fit = self.fits[i]
        if fit is None:
            known = [self.step_line(j) for j in range(self.n) if self.fits[j] is not None]
            if known:
                return tuple(sum(col) / len(known) for col in zip(*known, strict=True))
            return PRIOR_STEP_S, PRIOR_STEP_S / self.load_bound
        w, sx, sy, sxx, sxy = fit
        mx, my, var = sx / w, sy / w, sxx / w - (sx / w) ** 2
        b = (sxy / w - mx * my) / var if var >= 1.0 else my / (2 * max(mx, 1.0))
        b = min(max(b, 0.0), my / max(mx, 1.0))
        return max(my - b * mx, 0.0), b

    def choose(self, prompt_ids: Sequence[int], hashes: Sequence[int],
               max_tokens: int | None = None) -> tuple[int | None, int]:
        """(instance the policy picks or None, its estimated reused prompt tokens: cached there,
        or pooled when the pool holds more, since an engine fetches a longer pooled prefix)."""
        loads = self.loads(prompt_ids, hashes, max_tokens)
        i = self.policy(loads, len(prompt_ids), self.turn)
        if i is None:
            return None, 0
        return i, max(loads[i].cached_tokens, loads[i].pooled_tokens)

    def dispatch(self, i: int, prompt_ids: list[int], hashes: Sequence[int], cached: int,
                 max_tokens: int, now: float) -> Flight:
        """Record a request sent to instance i (it will hold the prompt's prefixes; the pool
        from its first token on); `cached`: the reused prompt tokens `choose` estimated."""
        self.turn += 1
        flight = Flight(i, prompt_ids, max_tokens, len(prompt_ids) - cached, now)
        self.flights[i].append(flight)
        local = min(self.index.matched(hashes)[i], len(prompt_ids) - 1)
        self.index.add(i, hashes)
        c = self.counters
        c[f"instance{i}_requests"] += 1
        c[f"instance{i}_prompt_tokens"] += len(prompt_ids)
        c[f"instance{i}_cache_hit_tokens"] += cached
        c[f"instance{i}_pool_fetch_tokens"] += max(cached - local, 0)
        c[f"instance{i}_queue_peak"] = max(c[f"instance{i}_queue_peak"], len(self.flights[i]))
        return flight

    def token(self, flight: Flight, now: float, count: int = 1) -> None:
        """`count` tokens of `flight` arrived at `now`; the first one gives a prefill sample."""
        i = flight.instance
        if flight.first_at is None:
            flight.first_at = now
            if self.pool is not None:  # its prefill published the prompt's blocks
                self.pool.add(0, block_hashes(flight.prompt_ids))
            if flight.uncached >= BLOCK and now > flight.sent_at:
                self._sample(self.prefill_tok_s, i, flight.uncached / (now - flight.sent_at))
            flight.produced, count = 1, count - 1
        flight.produced += count  # decode steps, each shared with the flights there now
        flight.batch_sum += count * len(self.flights[i])

    def land(self, flight: Flight, completion_ids: list[int] | None, now: float) -> None:
        """`flight` ended: finished with `completion_ids` (its prefix is recorded and the step
        time sampled), or aborted/failed (None)."""
        i = flight.instance
        self.flights[i].remove(flight)
        if completion_ids is None:
            return
        if self.versions[i] == self.version:  # KV built by weights the record still describes
            hashes = block_hashes(flight.prompt_ids + completion_ids[:-1])
            self.index.add(i, hashes)
            if self.pool is not None:
                self.pool.add(0, hashes)
        c = len(completion_ids)
        self.mean_completion = c if self.mean_completion is None else (
            (1 - EWMA) * self.mean_completion + EWMA * c)
        if flight.first_at is not None and flight.produced >= 2 and now > flight.first_at:
            steps = flight.produced - 1
            self._fit(i, flight.batch_sum / steps, (now - flight.first_at) / steps)

    def stats(self) -> dict[str, int | float]:
        """Flat counters per instance: requests, prompt_tokens, cache_hit_tokens (estimated, pool
        fetches included), pool_fetch_tokens (estimated), queue_depth (in flight now),
        queue_peak, healthy (0/1), prefill_tok_s, and the step line
        step_s, row_s (seconds; 0 until measured)."""
        out = dict(self.counters)
        for i in range(self.n):
            out[f"instance{i}_queue_depth"] = len(self.flights[i])
            out[f"instance{i}_healthy"] = int(self.routable(i))
            out[f"instance{i}_prefill_tok_s"] = self._rate(self.prefill_tok_s, i, 0.0)
            a, b = self.step_line(i) if self.fits[i] is not None else (0.0, 0.0)
            out[f"instance{i}_step_s"], out[f"instance{i}_row_s"] = a, b
        return out

    def _fit(self, i: int, x: float, y: float) -> None:
        old = self.fits[i] or [0.0] * 5
        keep = 1 - FIT_DECAY if self.fits[i] is not None else 0.0
        self.fits[i] = [keep * o + v for o, v in zip(old, (1.0, x, y, x * x, x * y), strict=True)]

    def _rate(self, rates: list[float | None], i: int, prior: float) -> float:
        own = rates[i]
        if own is not None:
            return own
        known = [r for r in rates if r is not None]
        return sum(known) / len(known) if known else prior

    @staticmethod
    def _sample(rates: list[float | None], i: int, value: float) -> None:
        old = rates[i]
        rates[i] = value if old is None else (1 - EWMA) * old + EWMA * value
