"""The capacity router's policy: which replica should take a request, best first.

Decided here, as pure arithmetic over plain data (no ray, no torch, no I/O):

- whether a replica *can seat* a request now, from its latest
  :class:`~ferrox.replicas.types.CapacitySnapshot` plus what this router
  itself sent it since that snapshot was taken;
- the order among the replicas that can: most leading prefix pages already
  cached there first (they skip that much prefill and reserve that much
  less), then the most KV headroom left after seating it, then replica id,
  so equal inputs always give the same answer. A prefix hit counts only on
  a replica whose load (running + waiting + routed since its snapshot) is
  within :data:`PREFIX_IMBALANCE_REQUESTS` of the least loaded one that can
  seat the request (SGLang's cache-aware router has the same guard): a page
  every request shares -- a chat template's default system prompt -- would
  otherwise pull all traffic onto whichever replica cached it first;
- the order among those that cannot: the shortest expected wait
  (:func:`expected_wait_s`), then the fewest waiting requests, then id;
- what to do when snapshots are missing or stale: rank by queue length, and
  never raise;
- the *routed-since ledger* (:class:`RoutedLedger`): the router's own
  account of requests it sent after a replica's last snapshot.

The seating rule mirrors the replica's admission (DESIGN.md "Memory models",
seed/admission.rs): a request reserves ``ceil_to_page(prompt - cached prefix
+ max_tokens)`` KV tokens at admission, takes one request slot, three
recurrent-state slots on a recurrent model, and at least one window page on
a sliding-window model. The router checks the same quantities against a
snapshot, so a replica it calls "can seat" would admit the request on its
next step unless something else arrived first (other routers, see below).

Deliberately not here:

- Serve's plumbing (RunningReplica, PendingRequest, the ranking shape Serve
  wants): that is :mod:`ferrox.cluster.router`.
- An exact window-pool check. The snapshot does not carry the window size,
  so the router only keeps requests off a replica whose window pool cannot
  give one more page after what it routed there; the replica's own
  admission applies the full ``min(prompt, window) + 1 page`` rule.
- Coordination between routers. Every DeploymentHandle (each ingress
  replica, each proxy) owns a router and a ledger; each only knows its own
  traffic since the last snapshot. A short stats period bounds the error.
- Clock-skew correction. Snapshot age and ledger settling compare the
  replica's ``time.time()`` with the router's; on one node (or NTP-synced
  nodes) the skew is far below the stats period.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Sequence

from ferrox.replicas.types import CapacitySnapshot, GenerateRequest

Outcome = Literal["seat_fit", "prefix_hit", "wait", "fallback"]

RECURRENT_SLOTS_PER_REQUEST = 3
"""Recurrent-state slots a request takes: live state plus two ping-pong snapshots (DESIGN.md)."""

PREFIX_IMBALANCE_REQUESTS = 4
"""How many more requests (running + waiting + routed since the snapshot) a
replica may carry than the least loaded one that can seat a request, and
still be preferred for a prefix hit. After SGLang's cache-aware router
(``balance_abs_threshold``, 32 there for GPU batch sizes), scaled to the
small batches of CPU replicas."""

MIN_DECODE_TOKENS_PER_S = 1.0
"""Floor on a snapshot's decode rate in wait estimates, tokens/s.

A replica that has not decoded recently reports 0; dividing by the floor
keeps its estimate finite and still ordered by how much must be freed."""


def align_ceil(n: int, page_size: int) -> int:
    """``n`` rounded up to a whole number of pages, in tokens (``n <= 0`` gives 0)."""
    if n <= 0:
        return 0
    page = max(1, int(page_size))
    return -(-n // page) * page


@dataclass(frozen=True)
class RequestShape:
    """What the policy needs to know of a request.

    ``prompt_len``: prompt tokens (>= 0). ``max_tokens``: output budget
    (>= 1), reserved whole at admission. ``prefix_hashes``: chained hashes of
    the prompt's full pages, in order
    (:func:`ferrox.scheduler.radix.page_hashes` at the cluster's page size).
    """

    prompt_len: int
    max_tokens: int
    prefix_hashes: tuple[int, ...] = ()

    @classmethod
    def of(cls, request: GenerateRequest) -> "RequestShape":
        return cls(
            prompt_len=request.prompt_len,
            max_tokens=request.params.max_tokens,
            prefix_hashes=tuple(request.prefix_hashes),
        )


@dataclass(frozen=True)
class Candidate:
    """One replica as the policy sees it.

    - ``snapshot``: its latest capacity snapshot, ``None`` if it has not
      reported one (a new replica) or it could not be parsed.
    - ``age_s``: seconds since ``snapshot.timestamp`` (router's clock minus
      replica's); ignored when ``snapshot`` is ``None``.
    - ``routed_requests`` / ``routed_tokens``: what this router sent the
      replica after the snapshot was taken (:meth:`RoutedLedger.totals`);
      tokens are page-rounded reservations as :func:`tokens_needed` computes.
    - ``queue_len``: requests queued or running there: the larger of Serve's
      count (its queue-length cache) and this router's in-flight count
      (:meth:`RoutedLedger.in_flight`); ``None`` counts as 0. Used only when
      the snapshot cannot be.
    """

    replica_id: str
    snapshot: CapacitySnapshot | None
    age_s: float = 0.0
    routed_requests: int = 0
    routed_tokens: int = 0
    queue_len: int | None = None


@dataclass(frozen=True)
class Assessment:
    """The policy's reading of one candidate with a fresh snapshot.

    ``hit_pages``: leading prompt pages held in the replica's prefix digest.
    ``need_tokens``: the KV tokens seating the request reserves there.
    ``headroom_tokens``: ``kv_tokens_available - routed_tokens - need_tokens``
    (negative when it does not fit). ``wait_s``: :func:`expected_wait_s`, 0.0
    when it can seat the request now.
    """

    replica_id: str
    can_seat: bool
    hit_pages: int
    need_tokens: int
    headroom_tokens: int
    wait_s: float
    waiting_requests: int
    #: Running + waiting requests in the snapshot plus those routed since.
    load: int = 0


@dataclass(frozen=True)
class Decision:
    """The policy's answer.

    ``ranking``: every candidate's replica id, best first (none is dropped,
    so Serve can still fall through to the last one if all others refuse).
    ``outcome``: how the first one was chosen, for metrics:

    - ``"prefix_hit"``: it can seat the request and holds at least one of its
      leading prefix pages;
    - ``"seat_fit"``: it can seat the request, no prefix page cached there;
    - ``"wait"``: no replica with a fresh snapshot can seat it; the first has
      the shortest expected wait;
    - ``"fallback"``: chosen by queue length, because its snapshot is
      missing, stale or unhealthy, or the request is not a generate request.

    ``best``: the first replica's :class:`Assessment`, ``None`` on fallback.
    """

    ranking: tuple[str, ...]
    outcome: Outcome
    best: Assessment | None = None
    assessments: dict[str, Assessment] = field(default_factory=dict, compare=False, repr=False)


def prefix_hit_pages(prefix_hashes: Sequence[int], digest: Iterable[int]) -> int:
    """Leading entries of ``prefix_hashes`` present in ``digest``.

    Only the leading run counts: the hashes are chained, so page ``i`` is
    reusable only if pages ``0..i-1`` are too, and a bounded MRU digest may
    hold a deep page whose ancestors it has already dropped.
    """
    held = digest if isinstance(digest, (set, frozenset)) else frozenset(digest)
    hits = 0
    for h in prefix_hashes:
        if h not in held:
            break
        hits += 1
    return hits


def tokens_needed(request: RequestShape, snapshot: CapacitySnapshot | None, hit_pages: int | None = None) -> int:
    """KV tokens the request reserves on the replica that sent ``snapshot``.

    ``ceil_to_page(prompt_len - hit_pages * page_size + max_tokens)`` (the
    seed's admission rule, seed/admission.rs). Without a snapshot the page
    size is unknown: the unrounded ``prompt_len + max_tokens``.
    """
    if snapshot is None:
        return request.prompt_len + request.max_tokens
    page = max(1, snapshot.page_size)
    if hit_pages is None:
        hit_pages = prefix_hit_pages(request.prefix_hashes, snapshot.prefix_digest)
    uncached = max(0, request.prompt_len - hit_pages * page)
    return align_ceil(uncached + request.max_tokens, page)


def _requests_short(snapshot: CapacitySnapshot, routed_requests: int) -> int:
    """How many requests ahead must finish before one more gets a slot of every kind it needs.

    Request slots: waiting requests are admitted first (FIFO), then what this
    router routed since, then this one. Recurrent slots: three per request.
    Window pool: at least one page per request.
    """
    short = max(0, snapshot.waiting_requests + routed_requests + 1 - snapshot.free_slots)
    if snapshot.recurrent_slots_available is not None:
        missing = RECURRENT_SLOTS_PER_REQUEST * (routed_requests + 1) - snapshot.recurrent_slots_available
        short = max(short, -(-max(0, missing) // RECURRENT_SLOTS_PER_REQUEST))
    if snapshot.swa_tokens_available is not None:
        page = max(1, snapshot.page_size)
        missing_pages = (routed_requests + 1) - snapshot.swa_tokens_available // page
        short = max(short, max(0, missing_pages))
    return short


def expected_wait_s(
    snapshot: CapacitySnapshot,
    need_tokens: int,
    routed_requests: int = 0,
    routed_tokens: int = 0,
    min_decode_tokens_per_s: float = MIN_DECODE_TOKENS_PER_S,
) -> float:
    """Estimated seconds until the replica could seat a request reserving ``need_tokens``.

    ``blocking = max(token_shortfall, requests_short * need_tokens)`` tokens,
    divided by ``max(decode_tokens_per_s, min_decode_tokens_per_s)``, where

    - ``token_shortfall = max(0, need + routed_tokens - kv_tokens_available)``:
      the pool that must be released first. ``kv_tokens_available`` is
      already net of what running *and waiting* requests reserve, so waiting
      requests are counted there (not again), and a negative value
      (an over-subscribed queue) rightly deepens the shortfall;
    - ``requests_short``: requests that must finish before a request slot,
      three recurrent slots and a window page are all free
      (:func:`_requests_short`). Each is priced at one reservation of this
      request's size, the only reservation size the router knows.

    Why divide by the decode rate: reservations are released when requests
    finish, and requests finish as fast as their output tokens are decoded.
    A finishing request releases its prompt *and* its output, so the pool
    frees at least ``decode_tokens_per_s`` tokens per second; the estimate
    is therefore an upper bound. It is a ranking signal between replicas of
    one model, not a latency promise. Returns 0.0 when nothing blocks.
    """
    token_shortfall = max(0, need_tokens + routed_tokens - snapshot.kv_tokens_available)
    blocking = max(token_shortfall, _requests_short(snapshot, routed_requests) * need_tokens)
    if blocking <= 0:
        return 0.0
    return blocking / max(snapshot.decode_tokens_per_s, min_decode_tokens_per_s)


def assess(
    request: RequestShape,
    candidate: Candidate,
    min_decode_tokens_per_s: float = MIN_DECODE_TOKENS_PER_S,
) -> Assessment:
    """Read one candidate that has a snapshot (freshness is the caller's check).

    It can seat the request iff, after what was routed there since the snapshot:
    ``free_slots - routed_requests >= 1``;
    ``kv_tokens_available - routed_tokens >= need``;
    ``recurrent_slots_available >= 3 + 3 * routed_requests`` (if that pool exists);
    ``swa_tokens_available - page_size * routed_requests >= page_size`` (if that pool exists).

    Waiting requests are not subtracted from ``free_slots`` here: with free
    slots they are most often waiting only for the next steps' prefill
    budget, and their KV reservations are already out of
    ``kv_tokens_available``. In the wait estimate, where the replica is
    known to be short, they do queue ahead (:func:`_requests_short`).
    """
    snap = candidate.snapshot
    assert snap is not None
    hits = prefix_hit_pages(request.prefix_hashes, snap.prefix_digest)
    need = tokens_needed(request, snap, hits)
    routed_n, routed_t = candidate.routed_requests, candidate.routed_tokens
    headroom = snap.kv_tokens_available - routed_t - need
    can_seat = snap.free_slots - routed_n >= 1 and headroom >= 0
    if can_seat and snap.recurrent_slots_available is not None:
        can_seat = snap.recurrent_slots_available >= RECURRENT_SLOTS_PER_REQUEST * (1 + routed_n)
    if can_seat and snap.swa_tokens_available is not None:
        page = max(1, snap.page_size)
        can_seat = snap.swa_tokens_available - page * routed_n >= page
    wait = 0.0 if can_seat else expected_wait_s(snap, need, routed_n, routed_t, min_decode_tokens_per_s)
    return Assessment(
        replica_id=candidate.replica_id,
        can_seat=can_seat,
        hit_pages=hits,
        need_tokens=need,
        headroom_tokens=headroom,
        wait_s=wait,
        waiting_requests=snap.waiting_requests,
        load=snap.running_requests + snap.waiting_requests + routed_n,
    )


def _queue_key(c: Candidate) -> tuple[int, str]:
    return (c.queue_len or 0, c.replica_id)


def rank_by_queue(candidates: Sequence[Candidate]) -> Decision:
    """Fewest queued requests first, then replica id; outcome ``"fallback"``."""
    ranked = tuple(c.replica_id for c in sorted(candidates, key=_queue_key))
    return Decision(ranking=ranked, outcome="fallback")


def rank_replicas(
    request: RequestShape | None,
    candidates: Sequence[Candidate],
    *,
    stale_after_s: float,
    min_decode_tokens_per_s: float = MIN_DECODE_TOKENS_PER_S,
) -> Decision:
    """Rank ``candidates`` for ``request``, best first. Never raises on missing data.

    A snapshot is *fresh* if present, ``age_s <= stale_after_s`` and
    ``healthy``. The ranking is four tiers, each fully ordered:

    1. fresh and can seat it now (:func:`assess`): most leading prefix-hit
       pages (counted only within :data:`PREFIX_IMBALANCE_REQUESTS` of the
       least loaded), then most headroom, then replica id;
    2. no usable snapshot (missing or stale): fewest queued, then id. These
       go before replicas known to be full: a replica without a snapshot is
       most often one that has just started (an autoscaling step taken
       precisely because the others are full), and an unknown replica may
       have room where a known-full one certainly has none;
    3. fresh but cannot seat it: shortest :func:`expected_wait_s`, then
       fewest waiting requests, then id;
    4. snapshot says unhealthy: fewest queued, then id (kept so a request
       still has somewhere to go if every other replica refuses it).

    ``request=None`` (not a generate call, e.g. a health probe) ranks
    everything by queue length. When no replica has a fresh snapshot, tiers
    1 and 3 are empty and the result is the queue-length fallback.
    """
    if request is None:
        return rank_by_queue(candidates)
    seatable: list[Assessment] = []
    waiting: list[Assessment] = []
    unknown: list[Candidate] = []
    unhealthy: list[Candidate] = []
    for c in candidates:
        snap = c.snapshot
        if snap is None or c.age_s > stale_after_s:
            unknown.append(c)
        elif not snap.healthy:
            unhealthy.append(c)
        else:
            a = assess(request, c, min_decode_tokens_per_s)
            (seatable if a.can_seat else waiting).append(a)
    if seatable:
        least = min(a.load for a in seatable)
        balanced = {a.replica_id for a in seatable if a.load - least <= PREFIX_IMBALANCE_REQUESTS}
        seatable.sort(
            key=lambda a: (-(a.hit_pages if a.replica_id in balanced else 0), -a.headroom_tokens, a.replica_id)
        )
    unknown.sort(key=_queue_key)
    waiting.sort(key=lambda a: (a.wait_s, a.waiting_requests, a.replica_id))
    unhealthy.sort(key=_queue_key)
    ranking = (
        tuple(a.replica_id for a in seatable)
        + tuple(c.replica_id for c in unknown)
        + tuple(a.replica_id for a in waiting)
        + tuple(c.replica_id for c in unhealthy)
    )
    assessments = {a.replica_id: a for a in seatable + waiting}
    if seatable:
        best = seatable[0]
        hit = best.hit_pages > 0 and best.replica_id in balanced
        return Decision(ranking, "prefix_hit" if hit else "seat_fit", best, assessments)
    if unknown or not waiting:
        return Decision(ranking, "fallback", None, assessments)
    return Decision(ranking, "wait", waiting[0], assessments)


class RoutedLedger:
    """The router's own account of what it sent each replica.

    Two books, keyed by a request key (Serve's ``internal_request_id``):

    - *since-snapshot* entries ``(tokens, routed_at)`` per replica: requests
      the replica's latest snapshot may not count yet. :meth:`settle` drops
      every entry routed at or before a snapshot's ``timestamp``: that
      snapshot already counts them (in ``waiting_*``, ``running_requests``
      and a smaller ``kv_tokens_available``), so keeping them would count
      them twice. :meth:`completed` drops one too: a finished request has
      released its reservation, and a snapshot older than its completion
      never counted it as free, nor will a newer one count it as used.
    - *in-flight* keys per replica: sent and not yet completed, whatever
      the snapshots say. The queue-length fallback reads this (with the
      provisional entries) next to Serve's own queue length.

    :meth:`record` writes a provisional since-snapshot entry when the policy
    picks a replica, before Serve has sent anything, so a burst of requests
    ranked back to back does not pile onto the same replica; :meth:`routed`
    confirms it (possibly on another replica, with a fresh timestamp).
    A provisional entry that is never confirmed (the request was cancelled)
    is cleared by the next snapshot. One approximation, accepted: a request
    accepted by a replica just before a snapshot but not yet handed to its
    engine is settled without being counted, for one stats period at most.
    Not thread-safe; the caller locks.
    Times are seconds on the ``time.time()`` clock.
    """

    def __init__(self) -> None:
        self._since: dict[str, dict[str, tuple[int, float]]] = {}
        self._where: dict[str, str] = {}
        self._in_flight: dict[str, set[str]] = {}

    def record(self, key: str, replica_id: str, tokens: int, at: float) -> None:
        """Put ``key``'s since-snapshot entry on ``replica_id`` (replacing any earlier one)."""
        self._drop_since(key)
        self._since.setdefault(replica_id, {})[key] = (int(tokens), float(at))
        self._where[key] = replica_id

    def routed(self, key: str, replica_id: str, tokens: int, at: float, *, counts_capacity: bool = True) -> None:
        """``key`` was sent to ``replica_id`` at ``at``: in flight there, and counted
        against its capacity until a snapshot newer than ``at`` arrives
        (``counts_capacity=False`` for calls that take no slot, e.g. health probes)."""
        if counts_capacity:
            self.record(key, replica_id, tokens, at)
        else:
            self._drop_since(key)
        for keys in self._in_flight.values():
            keys.discard(key)
        self._in_flight.setdefault(replica_id, set()).add(key)

    def completed(self, key: str, replica_id: str) -> None:
        """``key`` finished (or failed, or was refused) on ``replica_id``.

        Entries of ``key`` on another replica are kept: a refused request is
        re-ranked under the same key, and its refusal may be reported after
        the new provisional entry was written.
        """
        if self._where.get(key) == replica_id:
            self._drop_since(key)
        keys = self._in_flight.get(replica_id)
        if keys is not None:
            keys.discard(key)

    def settle(self, replica_id: str, snapshot_timestamp: float) -> int:
        """Drop ``replica_id``'s entries routed at or before ``snapshot_timestamp``; return how many."""
        entries = self._since.get(replica_id)
        if not entries:
            return 0
        covered = [k for k, (_, at) in entries.items() if at <= snapshot_timestamp]
        for k in covered:
            del entries[k]
            self._where.pop(k, None)
        return len(covered)

    def totals(self, replica_id: str) -> tuple[int, int]:
        """``(requests, tokens)`` routed to ``replica_id`` since its last settled snapshot."""
        entries = self._since.get(replica_id)
        if not entries:
            return 0, 0
        return len(entries), sum(t for t, _ in entries.values())

    def in_flight(self, replica_id: str) -> int:
        """Requests sent (or provisionally headed) to ``replica_id`` and not completed.

        Provisional entries count: in a burst, requests are ranked back to
        back before Serve has sent any of them, and a queue-length fallback
        that ignored them would send the whole burst to one replica.
        """
        sent = self._in_flight.get(replica_id, set())
        headed = self._since.get(replica_id, {})
        return len(sent) + sum(1 for k in headed if k not in sent)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in ``replica_ids`` (it left the deployment)."""
        keep = set(replica_ids)
        for rid in [r for r in self._since if r not in keep]:
            for k in self._since.pop(rid):
                self._where.pop(k, None)
        for rid in [r for r in self._in_flight if r not in keep]:
            del self._in_flight[rid]

    def _drop_since(self, key: str) -> None:
        rid = self._where.pop(key, None)
        if rid is not None:
            self._since.get(rid, {}).pop(key, None)


__all__ = [
    "PREFIX_IMBALANCE_REQUESTS",
    "Assessment",
    "Candidate",
    "Decision",
    "MIN_DECODE_TOKENS_PER_S",
    "Outcome",
    "RECURRENT_SLOTS_PER_REQUEST",
    "RequestShape",
    "RoutedLedger",
    "align_ceil",
    "assess",
    "expected_wait_s",
    "prefix_hit_pages",
    "rank_by_queue",
    "rank_replicas",
    "tokens_needed",
]
