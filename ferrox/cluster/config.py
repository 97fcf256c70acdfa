"""The application's configuration: what `serve run` / `serve deploy` / Helm pass as `args`.

Decided here: the one schema for the arguments of
``ferrox.cluster.app:build_app`` (model, replica count or autoscaling, engine
settings, router settings, ingress settings), with defaults that serve the
embedded model on a CPU box. Every entry point (the serve YAMLs in deploy/,
the Helm chart's serveConfigV2, ``ferrox serve``) goes through
:class:`AppArgs`, so an unknown or out-of-range key is refused with pydantic's
message naming it, before any replica starts.

Deliberately not here: Ray Serve's own deployment options beyond the few a
user needs (replicas, autoscaling, actor resources); the rest stay Serve's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineArgs(_Strict):
    """Per-replica engine settings (see ferrox.replicas.engine)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on CUDA and on CPUs with AMX-BF16, else float32"
    )
    quantization: Literal["auto", "none", "gguf_int4"] = Field(
        "auto",
        description="gguf_int4: keep a GGUF's Q4_0/Q4_1 weights as int4 for steps of few tokens (CPU, "
        "bfloat16); auto: gguf_int4 where it can run, else none",
    )
    attention_backend: Literal["auto", "sdpa", "flash"] = "auto"
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    max_num_seqs: int = Field(64, ge=1, description="request slots per replica")
    max_prefill_tokens: int = Field(2048, ge=1, description="prefill token budget per step (chunk size)")
    max_model_len: int | None = Field(None, ge=1, description="context limit; default: the model's")
    kv_cache_bytes: int = Field(1 << 30, ge=1 << 20, description="KV pool size on CPU, bytes")
    gpu_memory_utilization: float = Field(0.90, gt=0.0, le=1.0)
    enable_prefix_caching: bool = True
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads; default: the replica's CPUs")
    max_waiting_requests: int = Field(1024, ge=1, description="requests queued in one replica before it refuses")
    num_recurrent_slots: int | None = Field(
        None, ge=3, description="recurrent-state slots (hybrid models; 3 per request); null: sized from the budget"
    )
    seed: int = 0


class RouterArgs(_Strict):
    """Capacity router settings (see ferrox.cluster.router)."""

    stats_period_s: float = Field(0.5, gt=0.0, description="how often replicas report capacity")
    stats_timeout_s: float = Field(2.0, gt=0.0)
    stale_after_s: float = Field(5.0, gt=0.0, description="older snapshots fall back to queue length")


class AutoscalingArgs(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(32.0, gt=0.0)
    initial_replicas: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscalingArgs":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})"
            )
        return self


class IngressArgs(_Strict):
    num_replicas: int = Field(1, ge=1)
    max_waiting_requests: int = Field(
        1024, ge=1, description="requests in flight across the app before new ones get 503"
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="largest request body accepted, bytes; larger ones get 413"
    )


class AppArgs(_Strict):
    """``args`` of ``ferrox.cluster.app:build_app``."""

    model: str = "SmolLM2-135M-Instruct"
    served_model_name: str | None = None
    num_replicas: int | None = Field(None, ge=1)
    autoscaling_config: AutoscalingArgs | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    engine: EngineArgs = Field(default_factory=EngineArgs)
    router: RouterArgs = Field(default_factory=RouterArgs)
    ingress: IngressArgs = Field(default_factory=IngressArgs)

    @model_validator(mode="after")
    def _one_scaling_mode(self) -> "AppArgs":
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        if self.num_replicas is None and self.autoscaling_config is None:
            self.num_replicas = 2
        return self
