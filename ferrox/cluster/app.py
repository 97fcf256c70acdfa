"""The application builder: ``ferrox.cluster.app:build_app`` for ``serve run`` / ``serve deploy``.

Decided here: how :class:`~ferrox.cluster.config.AppArgs` become a Serve
application -- one ``FerroxReplica`` deployment (fixed replicas or
autoscaling, one GPU each in GPU configs, a CPU share each on a CPU box),
routed by :class:`~ferrox.cluster.router.CapacityRouter` with a
routing-stats period well under Serve's 10 s default, behind one
``FerroxIngress`` deployment that speaks OpenAI HTTP.

Deliberately not here: starting Ray or Serve (``ferrox serve`` and
``serve run`` do), and any default that differs from ``AppArgs``.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from ferrox.replicas.deployment import FerroxReplica

from .config import AppArgs
from .ingress import FerroxIngress

REPLICA_DEPLOYMENT = "FerroxReplica"
INGRESS_DEPLOYMENT = "FerroxIngress"


def engine_config(args: AppArgs) -> dict:
    """The replica's EngineConfig dict from the app args."""
    engine = args.engine.model_dump()
    engine["model"] = args.model
    engine["served_model_name"] = args.served_model_name
    return engine


def replica_deployment_options(args: AppArgs) -> dict[str, Any]:
    from .router import request_router_config

    options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "ray_actor_options": dict(args.ray_actor_options),
        "request_router_config": request_router_config(args.router),
        # An engine admits far more than Serve's default of 5 concurrent calls;
        # its own scheduler queues and the router places work by capacity.
        "max_ongoing_requests": args.engine.max_num_seqs + args.engine.max_waiting_requests,
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
    }
    if args.autoscaling_config is not None:
        a = args.autoscaling_config
        auto = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
        }
        if a.initial_replicas is not None:
            auto["initial_replicas"] = a.initial_replicas
        options["autoscaling_config"] = auto
    else:
        options["num_replicas"] = args.num_replicas
    return options


def build_app(args: dict | AppArgs | None = None) -> Application:
    """Build the ferrox Serve application from ``args`` (see :class:`AppArgs`).

    Raises ``pydantic.ValidationError`` naming any unknown or out-of-range key.
    """
    parsed = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    replica = serve.deployment(FerroxReplica).options(**replica_deployment_options(parsed))
    ingress = serve.deployment(FerroxIngress).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=parsed.ingress.num_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=parsed.ingress.max_waiting_requests + 64,
    )
    return ingress.bind(
        replica.bind(engine_config(parsed)),
        max_waiting_requests=parsed.ingress.max_waiting_requests,
        max_request_bytes=parsed.ingress.max_request_bytes,
        replica_deployment=REPLICA_DEPLOYMENT,
    )
