"""CapacityRouter inside a real Ray Serve router, on a local Ray cluster.

The replicas here are a small stand-in deployment, NOT the ferrox engine:
each reports a CapacitySnapshot whose figures the test sets (through a
named Ray actor, the "board", keyed by the replica's Serve id) and answers
``generate`` with its own replica id. That isolates what this module checks:
Serve pulls ``record_routing_stats`` at ``RouterArgs.stats_period_s``,
hands the dicts to CapacityRouter as ``RunningReplica.routing_stats``, and
the router's ranking decides where ``handle.generate.remote(GenerateRequest)``
lands. The end-to-end test with the engine's own snapshots comes with the
application builder.

Snapshots reach the router some time after the test sets them (the
stats period, the controller's loop, the long-poll broadcast), and until
both replicas' new snapshots are in, the router rightly decides on the old
ones. So the deployment uses :class:`ObservedCapacityRouter`, CapacityRouter
unchanged but for telling the board which figures ("generation", carried in
the snapshot's ``model`` field) each decision saw. A case counts only the
replies to requests ranked on the new figures of *both* replicas, and needs
IN_A_ROW of them, all from the expected replica (Serve's default
power-of-two router would spread them across both).
"""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from ferrox.cluster.config import RouterArgs  # noqa: E402
from ferrox.cluster.router import (  # noqa: E402
    CapacityRouter,
    generate_request_of,
    request_router_config,
)
from ferrox.replicas.types import CapacitySnapshot, GenerateRequest, SamplingParams  # noqa: E402

NAMESPACE = "ferrox-router-test"
BOARD = "snapshot-board"
PAGE = 16
IN_A_ROW = 20


@ray.remote(num_cpus=0)
class SnapshotBoard:
    """Holds, per replica id, the snapshot figures the test wants it to report."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.figures: dict[str, dict] = {}
        self.views: dict[str, dict] = {}  # request id -> {replica id: generation it was ranked on}

    def register(self, replica_id: str) -> None:
        self.ids.append(replica_id)

    def replica_ids(self) -> list[str]:
        return sorted(self.ids)

    def set(self, replica_id: str, figures: dict) -> None:
        self.figures[replica_id] = figures

    def get(self, replica_id: str) -> dict | None:
        return self.figures.get(replica_id)

    def note(self, request_id: str, view: dict) -> None:
        self.views[request_id] = view

    def view_of(self, request_id: str) -> dict | None:
        return self.views.get(request_id)


class ObservedCapacityRouter(CapacityRouter):
    """CapacityRouter, plus a note to the board of the snapshot generations each ranking saw."""

    _board = None

    def rank(self, candidate_replicas, pending_request):
        view = {r.replica_id.unique_id: (r.routing_stats or {}).get("model") for r in candidate_replicas}
        decision = super().rank(candidate_replicas, pending_request)
        request = generate_request_of(pending_request)
        if request is not None:
            if self._board is None:
                self._board = ray.get_actor(BOARD, namespace=NAMESPACE)
            self._board.note.remote(request.request_id, view)
        return decision


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
class StandInReplica:
    """Not the engine: reports board-set capacity and names itself in replies."""

    def __init__(self) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.board = ray.get_actor(BOARD, namespace=NAMESPACE)
        ray.get(self.board.register.remote(self.replica_id))
        self.seq = 0

    async def record_routing_stats(self) -> dict:
        figures = await self.board.get.remote(self.replica_id)
        if figures is None:
            return {}
        self.seq += 1
        return CapacitySnapshot(
            replica_id=self.replica_id, seq=self.seq, timestamp=time.time(), **figures
        ).to_dict()

    async def generate(self, request: GenerateRequest) -> str:
        return self.replica_id

    async def ping(self) -> str:
        return self.replica_id


def figures(generation: str, kv_tokens_available: int, prefix_digest: tuple[int, ...] = ()) -> dict:
    return dict(
        model=generation,
        free_slots=64,
        max_slots=64,
        kv_tokens_available=kv_tokens_available,
        kv_tokens_total=131072,
        swa_tokens_available=None,
        recurrent_slots_available=None,
        waiting_requests=0,
        waiting_tokens=0,
        running_requests=0,
        page_size=PAGE,
        max_model_len=8192,
        prefix_digest=prefix_digest,
        decode_tokens_per_s=100.0,
    )


def request(n: str, prompt_len: int, max_tokens: int, prefix_hashes: tuple[int, ...] = ()) -> GenerateRequest:
    return GenerateRequest(
        request_id=n,
        prompt_token_ids=tuple(range(prompt_len)),
        params=SamplingParams(max_tokens=max_tokens),
        prefix_hashes=prefix_hashes,
    )


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        board = SnapshotBoard.options(name=BOARD).remote()
        serve.start(proxy_location="Disabled")
        app = StandInReplica.options(
            request_router_config=request_router_config(
                RouterArgs(stats_period_s=0.2), router_class=ObservedCapacityRouter
            )
        ).bind()
        handle = serve.run(app, name="router-test", route_prefix=None)
        deadline = time.monotonic() + 30
        while len(ray.get(board.replica_ids.remote())) < 2:
            assert time.monotonic() < deadline, "stand-in replicas did not start"
            time.sleep(0.1)
        yield handle, board, ray.get(board.replica_ids.remote())
    finally:
        serve.shutdown()
        ray.shutdown()


def replies_on_new_figures(handle, board, generation: str, make_request, timeout_s: float = 30.0) -> list[str]:
    """Send requests until IN_A_ROW were ranked on ``generation`` of both replicas; their replies."""
    deadline = time.monotonic() + timeout_s
    replies: list[str] = []
    n = 0
    while len(replies) < IN_A_ROW:
        assert time.monotonic() < deadline, f"only {len(replies)} requests ranked on {generation} in {timeout_s}s"
        request_id = f"{generation}-{n}"
        n += 1
        reply = handle.generate.remote(make_request(request_id)).result(timeout_s=10)
        view = ray.get(board.view_of.remote(request_id))
        while view is None:  # the note is sent before the request; it may land after the reply
            assert time.monotonic() < deadline, f"no ranking noted for {request_id}"
            time.sleep(0.01)
            view = ray.get(board.view_of.remote(request_id))
        if len(view) == 2 and all(g == generation for g in view.values()):
            replies.append(reply)
    return replies


def test_the_request_router_config_carries_the_router_and_the_stats_period():
    config = request_router_config(RouterArgs(stats_period_s=0.2, stats_timeout_s=1.5, stale_after_s=3.0))
    assert config.request_router_class == "ferrox.cluster.router.CapacityRouter"
    assert config.get_request_router_class().__name__ == CapacityRouter.__name__
    assert config.request_router_kwargs == {"stale_after_s": 3.0}
    assert config.request_routing_stats_period_s == 0.2
    assert config.request_routing_stats_timeout_s == 1.5


def test_the_request_router_config_refuses_a_router_that_is_not_a_capacity_router():
    from ray.serve.request_router import RequestRouter

    with pytest.raises(TypeError, match="CapacityRouter or a subclass"):
        request_router_config(RouterArgs(), router_class=RequestRouter)


def test_a_long_request_goes_to_the_replica_that_can_seat_it(cluster):
    handle, board, (a, b) = cluster
    # a: 300 KV tokens left; b: 100000. A 400 + 100 request reserves 512.
    ray.get([board.set.remote(a, figures("seat-1", 300)), board.set.remote(b, figures("seat-1", 100_000))])
    assert replies_on_new_figures(handle, board, "seat-1", lambda n: request(n, 400, 100)) == [b] * IN_A_ROW

    # swap the figures: now only a can seat it.
    ray.get([board.set.remote(a, figures("seat-2", 100_000)), board.set.remote(b, figures("seat-2", 300))])
    assert replies_on_new_figures(handle, board, "seat-2", lambda n: request(n, 400, 100)) == [a] * IN_A_ROW


def test_a_repeated_prefix_goes_to_the_replica_whose_digest_holds_it(cluster):
    handle, board, (a, b) = cluster
    hashes = (101, 102, 103, 104, 105, 106)  # the prompt's 6 full pages

    def prompt(n):
        return request(n, 6 * PAGE + 5, 20, hashes)

    # both can seat it; b has more headroom, a holds the prefix.
    ray.get(
        [
            board.set.remote(a, figures("prefix-1", 60_000, prefix_digest=hashes)),
            board.set.remote(b, figures("prefix-1", 90_000)),
        ]
    )
    assert replies_on_new_figures(handle, board, "prefix-1", prompt) == [a] * IN_A_ROW

    # the cached prefix moves to b.
    ray.get(
        [
            board.set.remote(a, figures("prefix-2", 90_000)),
            board.set.remote(b, figures("prefix-2", 60_000, prefix_digest=hashes)),
        ]
    )
    assert replies_on_new_figures(handle, board, "prefix-2", prompt) == [b] * IN_A_ROW


def test_a_call_without_a_generate_request_is_still_routed(cluster):
    handle, _, ids = cluster
    replies = {handle.ping.remote().result(timeout_s=10) for _ in range(4)}
    assert replies <= set(ids)
    assert len(replies) >= 1
