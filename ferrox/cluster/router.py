"""The capacity router: Ray Serve's side of :mod:`ferrox.cluster.routing`.

Decided here: how the policy plugs into Ray Serve 2.60's custom request
router API (``ray.serve.request_router.RequestRouter``):

- ``choose_replicas`` reads ``pending_request.args[0]`` as a
  :class:`~ferrox.replicas.types.GenerateRequest` (anything else, e.g. a
  health or info call, is ranked by queue length), turns each replica's
  ``routing_stats`` dict into a :class:`CapacitySnapshot`, applies
  :func:`~ferrox.cluster.routing.rank_replicas`, and returns one replica per
  rank, ``[[best], [second], ...]``. One per rank because Serve picks the
  *shortest queue* inside a rank; single-replica ranks make it follow the
  policy's order and only fall through to the next rank when a replica's
  Serve queue (``max_ongoing_requests``) is full.
- The routed-since ledger is fed by Serve's lifecycle hooks:
  ``choose_replicas`` writes a provisional entry for the top pick (so
  requests ranked back to back see each other), ``on_request_routed``
  confirms it on the replica that accepted, ``on_request_completed`` drops
  it. Serve calls ``on_request_routed`` only under its rejection protocol
  (the default outside Ray Client); without it the provisional entry stands
  in until the next snapshot settles it.
- Router settings arrive through ``RequestRouterConfig.request_router_kwargs``,
  which Serve passes to :meth:`CapacityRouter.initialize_state`.
  :func:`request_router_config` builds the whole config from
  :class:`~ferrox.cluster.config.RouterArgs`.

The router does not use Serve's FIFOMixin: with it, a replica found for one
request may be handed to whichever request is first in line, which would
send a long prompt to the replica chosen for a short one. Requests here are
matched to the replica chosen for them (Serve's default matching).

Deliberately not here: the policy's arithmetic (routing.py, testable
without Ray), the replica's ``record_routing_stats`` (replicas/deployment.py)
and the metrics' definitions (:mod:`ferrox.cluster.metrics`: each generate
request's decision is exported there by outcome, with its snapshot's age; it
is also counted in :attr:`CapacityRouter.outcome_counts` and passed to
:meth:`CapacityRouter.on_decision`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, List, Optional

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from ferrox.cluster.config import RouterArgs
from ferrox.cluster.metrics import RouterMetrics
from ferrox.cluster.routing import (
    MIN_DECODE_TOKENS_PER_S,
    Candidate,
    Decision,
    RequestShape,
    RoutedLedger,
    rank_replicas,
    tokens_needed,
)
from ferrox.replicas.types import CapacitySnapshot, GenerateRequest

logger = logging.getLogger("ray.serve")

ROUTER_CLASS_PATH = "ferrox.cluster.router.CapacityRouter"


def generate_request_of(pending_request: Optional[PendingRequest]) -> GenerateRequest | None:
    """The request's :class:`GenerateRequest`: its first positional argument, else
    the first keyword argument that is one; ``None`` for any other call."""
    if pending_request is None:
        return None
    args = pending_request.args or ()
    if args and isinstance(args[0], GenerateRequest):
        return args[0]
    for value in (pending_request.kwargs or {}).values():
        if isinstance(value, GenerateRequest):
            return value
    return None


def snapshot_of(routing_stats: Any) -> CapacitySnapshot | None:
    """``routing_stats`` as a snapshot; ``None`` when empty (no report yet) or not one."""
    if not routing_stats or not isinstance(routing_stats, dict):
        return None
    try:
        return CapacitySnapshot.from_dict(routing_stats)
    except (TypeError, ValueError, KeyError):
        return None


class CapacityRouter(RequestRouter):
    """Ranks replicas by whether they can seat the request now (see module docstring).

    ``request_router_kwargs`` (all optional): ``stale_after_s`` (float, s;
    default :class:`RouterArgs`'s), ``min_decode_tokens_per_s`` (float).
    Unknown keys raise ``TypeError`` when Serve builds the router.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stale_after_s: float = RouterArgs().stale_after_s
        self.min_decode_tokens_per_s: float = MIN_DECODE_TOKENS_PER_S
        self._ledger = RoutedLedger()
        # choose_replicas runs on Serve's router loop; completion callbacks may
        # run on another thread.
        self._lock = threading.Lock()
        self.outcome_counts: collections.Counter[str] = collections.Counter()
        self.last_decision: Decision | None = None
        self._metrics = RouterMetrics.create()

    def initialize_state(
        self,
        stale_after_s: float | None = None,
        min_decode_tokens_per_s: float | None = None,
    ) -> None:
        if stale_after_s is not None:
            if stale_after_s <= 0:
                raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
            self.stale_after_s = float(stale_after_s)
        if min_decode_tokens_per_s is not None:
            if min_decode_tokens_per_s <= 0:
                raise ValueError(f"min_decode_tokens_per_s must be > 0, got {min_decode_tokens_per_s}")
            self.min_decode_tokens_per_s = float(min_decode_tokens_per_s)

    # -- ranking -----------------------------------------------------------

    def _candidate(self, replica: RunningReplica, now: float) -> Candidate:
        uid = replica.replica_id.unique_id
        snapshot = snapshot_of(replica.routing_stats)
        if snapshot is not None:
            self._ledger.settle(uid, snapshot.timestamp)
        routed_n, routed_t = self._ledger.totals(uid)
        # Serve's count includes other routers' requests (replicas report it);
        # the ledger's includes this router's requests ranked but not yet sent.
        queue_len = max(self._replica_queue_len_cache.get(replica.replica_id) or 0, self._ledger.in_flight(uid))
        return Candidate(
            replica_id=uid,
            snapshot=snapshot,
            age_s=(now - snapshot.timestamp) if snapshot is not None else 0.0,
            routed_requests=routed_n,
            routed_tokens=routed_t,
            queue_len=queue_len,
        )

    def rank(self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest]) -> Decision:
        """The policy's decision for ``pending_request``; writes the provisional ledger entry."""
        now = time.time()
        request = generate_request_of(pending_request)
        shape = RequestShape.of(request) if request is not None else None
        with self._lock:
            candidates = [self._candidate(r, now) for r in candidate_replicas]
            decision = rank_replicas(
                shape,
                candidates,
                stale_after_s=self.stale_after_s,
                min_decode_tokens_per_s=self.min_decode_tokens_per_s,
            )
            if shape is not None and pending_request is not None and decision.ranking:
                top = decision.ranking[0]
                if decision.best is not None:
                    tokens = decision.best.need_tokens
                else:
                    snap = next(c.snapshot for c in candidates if c.replica_id == top)
                    tokens = tokens_needed(shape, snap)
                self._ledger.record(pending_request.metadata.internal_request_id, top, tokens, now)
            self.outcome_counts[decision.outcome] += 1
            self.last_decision = decision
        if shape is not None:
            self._metrics.decision(decision, candidates)
        self.on_decision(decision, pending_request)
        return decision

    def on_decision(self, decision: Decision, pending_request: Optional[PendingRequest]) -> None:
        """Hook for metrics export; called once per ranking. Does nothing here."""

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        try:
            decision = self.rank(candidate_replicas, pending_request)
        except Exception:  # never leave a request unroutable because of the policy
            logger.exception("CapacityRouter policy failed; routing by queue length")
            return [list(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in decision.ranking if rid in by_id]

    # -- Serve's lifecycle hooks --------------------------------------------

    def on_request_routed(
        self,
        pending_request: PendingRequest,
        replica_id: ReplicaID,
        result: ReplicaResult,
    ) -> None:
        """The replica accepted the request: confirm the ledger entry there, timed now."""
        request = generate_request_of(pending_request)
        uid = replica_id.unique_id
        now = time.time()
        tokens = 0
        if request is not None:
            replica = self._replicas.get(replica_id)
            snap = snapshot_of(replica.routing_stats) if replica is not None else None
            tokens = tokens_needed(RequestShape.of(request), snap)
        with self._lock:
            self._ledger.routed(
                pending_request.metadata.internal_request_id,
                uid,
                tokens,
                now,
                counts_capacity=request is not None,
            )

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            self._ledger.completed(internal_request_id, replica_id.unique_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        with self._lock:
            self._ledger.retain(r.replica_id.unique_id for r in replicas)


def request_router_config(
    args: RouterArgs, router_class: type[CapacityRouter] = CapacityRouter
) -> RequestRouterConfig:
    """The ``request_router_config`` for the engine deployment.

    Stats are pulled every ``args.stats_period_s`` (Serve's default is 10 s,
    far too slow for capacity routing) with ``args.stats_timeout_s``;
    ``args.stale_after_s`` reaches :meth:`CapacityRouter.initialize_state`.
    ``router_class``: :class:`CapacityRouter` or a subclass (e.g. one whose
    :meth:`~CapacityRouter.on_decision` exports metrics). Serve pickles it
    *by value* together with its module, so the module must import cleanly
    wherever a handle routes (ingress replicas, proxies).
    """
    if not (isinstance(router_class, type) and issubclass(router_class, CapacityRouter)):
        raise TypeError(f"router_class must be CapacityRouter or a subclass, got {router_class!r}")
    return RequestRouterConfig(
        request_router_class=router_class,
        request_router_kwargs={"stale_after_s": args.stale_after_s},
        request_routing_stats_period_s=args.stats_period_s,
        request_routing_stats_timeout_s=args.stats_timeout_s,
    )


__all__ = [
    "CapacityRouter",
    "ROUTER_CLASS_PATH",
    "generate_request_of",
    "request_router_config",
    "snapshot_of",
]
