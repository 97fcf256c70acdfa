"""``ferrox``: the command line.

- ``ferrox serve``: start (or join) a local Ray cluster, deploy the app, print
  the URL and a ready-to-paste curl, stop cleanly on Ctrl-C.
- ``ferrox generate``: run the engine offline in this process.
- ``ferrox bench offline``: the offline throughput benchmark (``bench.py``).
- ``ferrox grafana push``: upload the Grafana dashboard (``cluster/grafana.py``).

Decided here: argument names and exit codes (0 ok, 2 bad usage or a clear
operational error, 1 anything unexpected). Deliberately thin: every command
calls into the package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time


def _generate(ns: argparse.Namespace) -> int:
    from ferrox.replicas.config import EngineConfig
    from ferrox.replicas.engine import LLMEngine
    from ferrox.replicas.types import SamplingParams

    config = EngineConfig(
        model=ns.model,
        max_prefill_tokens=ns.max_prefill_tokens,
        kv_cache_bytes=ns.kv_cache_bytes,
        device=ns.device,
        torch_threads=ns.threads,
        attention_backend=ns.attention_backend,
        dtype=ns.dtype,
        quantization=ns.quantization,
    )
    engine = LLMEngine(config)
    try:
        if ns.prompt_token_ids:
            ids = [int(t) for t in ns.prompt_token_ids.split(",") if t.strip()]
        elif ns.chat:
            ids = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": ns.prompt}], add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            ids = engine.tokenizer(ns.prompt).input_ids
        try:
            params = SamplingParams(
                max_tokens=ns.max_tokens,
                temperature=ns.temperature,
                top_p=ns.top_p,
                top_k=ns.top_k,
                seed=ns.seed,
                stop=tuple(ns.stop or ()),
                ignore_eos=ns.ignore_eos,
            )
            stream = engine.add_request(ids, params)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        token_ids: list[int] = []
        text: list[str] = []
        last = None
        for chunk in stream:
            token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            if not ns.json:
                print(chunk.text, end="", flush=True)
            last = chunk
        assert last is not None
        if ns.json:
            print(json.dumps({
                "prompt_token_ids": ids,
                "token_ids": token_ids,
                "text": "".join(text),
                "finish_reason": last.finish_reason,
                "usage": {
                    "prompt_tokens": last.usage.prompt_tokens,
                    "completion_tokens": last.usage.completion_tokens,
                    "cached_tokens": last.usage.cached_tokens,
                } if last.usage else None,
            }))
        else:
            print()
            print(f"[finish_reason={last.finish_reason}]", file=sys.stderr)
        return 0
    finally:
        engine.shutdown()


def _load_serve_config(path: str) -> tuple[dict, dict]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f)
    apps = data.get("applications") or []
    for app in apps:
        if app.get("import_path") == "ferrox.cluster.app:build_app":
            return dict(app.get("args") or {}), dict(data.get("http_options") or {})
    raise SystemExit(f"error: {path} has no application with import_path ferrox.cluster.app:build_app")


def _serve(ns: argparse.Namespace) -> int:
    import ray
    from pydantic import ValidationError
    from ray import serve

    from ferrox.cluster.app import build_app
    from ferrox.cluster.config import AppArgs

    args: dict = {}
    http: dict = {}
    if ns.config:
        args, http = _load_serve_config(ns.config)
    if ns.model:
        args["model"] = ns.model
    if ns.replicas is not None:
        args.pop("autoscaling_config", None)
        args["num_replicas"] = ns.replicas
    try:
        parsed = AppArgs.model_validate(args)
    except ValidationError as exc:
        print(f"error: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    port = ns.port or int(http.get("port", 8000))
    host = ns.host or http.get("host", "127.0.0.1")

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started_ray = False
    address = ns.address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized() and not address:
        # Ray's HTTP proxy binds with SO_REUSEPORT, so a second ferrox on a
        # busy port would silently share it with the first; refuse instead.
        busy = _port_in_use(host, port)
        if busy:
            print(f"error: cannot serve on {host}:{port}: {busy} (pick another with --port)", file=sys.stderr)
            return 2
    if not ray.is_initialized():
        # Join a cluster only when told where it is: probing for one ("auto")
        # can latch onto a stale address and abort the process.
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            ray.init(logging_level=logging.WARNING)
            started_ray = True
    # One handler from here on (after ray.init, which installs its own):
    # while deploying, Ctrl-C interrupts the wait for the replicas; once
    # serving, it ends the loop below. Either way the app and, if started
    # here, the local Ray cluster are shut down.
    stop = {"now": False, "serving": False, "signal": None}

    def _handler(signum, frame):
        stop["now"] = True
        stop["signal"] = signum
        if not stop["serving"]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    try:
        serve.start(http_options={"host": host, "port": port})
        print(f">> deploying {parsed.model} on {parsed.num_replicas or 'autoscaled'} replica(s)...", flush=True)
        t0 = time.time()
        serve.run(build_app(parsed), name="ferrox", route_prefix="/", blocking=False)
        stop["serving"] = True
    except KeyboardInterrupt:
        print(">> interrupted while deploying; shutting down", flush=True)
        _shutdown(serve, ray, started_ray, delete_app=False, terminated=stop["signal"] == signal.SIGTERM)
        print(">> stopped")
        return 130
    url = f"http://{host}:{port}"
    name = parsed.served_model_name or parsed.model
    print(f">> ferrox is serving {name} at {url}/v1  (ready in {time.time() - t0:.0f}s)")
    print(">> try:")
    print(
        f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'"
    )
    print(">> Ctrl-C to stop", flush=True)
    try:
        while not stop["now"]:
            time.sleep(0.2)
    finally:
        print(">> shutting down", flush=True)
        _shutdown(serve, ray, started_ray, delete_app=True, terminated=stop["signal"] == signal.SIGTERM)
    print(">> stopped")
    return 0


#: Seconds ``ferrox serve`` waits for Serve and Ray to shut down before it exits anyway.
SHUTDOWN_TIMEOUT_S = 30.0


def _port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound (a plain bind, no SO_REUSEPORT), or ``None``."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _ray_head_alive() -> bool:
    """Whether the GCS server and raylet this process started still run. A Ctrl-C
    or SIGTERM sent to the whole process group (a terminal, ``timeout``,
    ``docker stop``) also kills the Ray processes ``ray.init`` started as our
    children; talking to the dead GCS would then block for a minute."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return True
    alive = set()
    for child in children:
        try:
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.name())
        except psutil.Error:
            continue
    # The Serve controller lives in a worker of the raylet; both must be up.
    return any("gcs_server" in n for n in alive) and any("raylet" in n for n in alive)


def _shutdown(serve, ray, started_ray: bool, *, delete_app: bool, terminated: bool = False) -> None:
    """Delete the app and stop Serve (and the local Ray cluster if we started
    it), within :data:`SHUTDOWN_TIMEOUT_S`.

    On SIGTERM (``terminated``) with a Ray cluster we started, Serve is not
    asked to drain: SIGTERM is "stop now", the cluster goes with
    ``ray.shutdown()`` anyway, and when the signal went to the whole process
    group (``timeout``, ``docker stop``) Ray's agents are already dying, so
    Serve calls would wait a minute on a half-dead cluster. Also skipped
    when the Ray head is gone (:func:`_ray_head_alive`)."""
    import threading

    def work() -> None:
        try:
            if not started_ray or (not terminated and _ray_head_alive()):
                if delete_app:
                    serve.delete("ferrox")
                serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()

    thread = threading.Thread(target=work, name="ferrox-shutdown", daemon=True)
    thread.start()
    thread.join(SHUTDOWN_TIMEOUT_S)
    if thread.is_alive():
        print(f">> shutdown did not finish in {SHUTDOWN_TIMEOUT_S:.0f}s; exiting", file=sys.stderr, flush=True)
        os._exit(1)


def _bench(ns: argparse.Namespace) -> int:
    from ferrox.bench import run_offline, write_tiny_model

    if getattr(ns, "tiny", None):
        import tempfile

        # The tiny model lives only as long as the run (it is ~28 MB).
        with tempfile.TemporaryDirectory(prefix=f"ferrox-tiny-{ns.tiny}-") as directory:
            ns.model = write_tiny_model(ns.tiny, directory)
            return run_offline(ns)
    return run_offline(ns)


def _grafana(ns: argparse.Namespace) -> int:
    from ferrox.cluster.grafana import push_command

    return push_command(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrox", description="LLM serving on Ray Serve")
    parser.add_argument("--log-level", default=os.environ.get("FERROX_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the model on a local Ray cluster (OpenAI API)")
    p.add_argument("--config", help="a Serve config YAML (e.g. deploy/serve.yaml)")
    p.add_argument("--model", help="model name or path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--replicas", type=int, help="number of engine replicas")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--host", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--address", help="join this Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    p.set_defaults(func=_serve)

    p = sub.add_parser("generate", help="generate offline, in this process")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--prompt", default="")
    p.add_argument("--chat", action="store_true", help="apply the chat template to --prompt")
    p.add_argument("--prompt-token-ids", help="comma-separated token ids instead of --prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print token ids, text and finish_reason as JSON")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf_int4"))
    p.add_argument("--max-prefill-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.set_defaults(func=_generate)

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("offline", help="offline throughput vs transformers")
    b.add_argument("--model", default="SmolLM2-135M-Instruct")
    b.add_argument("--prompts", type=int, default=64, help="prompts in the workload (W: 64)")
    b.add_argument("--single", type=int, default=8, help="prompts run one at a time (concurrency 1)")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--skip-transformers", action="store_true")
    b.add_argument("--tiny", choices=("window", "hybrid"),
                   help="write a tiny random model of that family to a temp dir and bench it (--model ignored)")
    b.add_argument("--device", default="auto")
    b.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="ferrox's dtype (auto: bfloat16 on CPUs with AMX-BF16, else float32)")
    b.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf_int4"),
                   help="ferrox's weight quantization (auto: GGUF int4 for small steps where it can run)")
    b.add_argument("--transformers-bf16", action="store_true",
                   help="also run transformers in bfloat16 (the issue's comparison stays float32)")
    b.set_defaults(func=_bench)

    p = sub.add_parser("grafana", help="Grafana dashboard")
    gsub = p.add_subparsers(dest="grafana", required=True)
    g = gsub.add_parser("push", help="create or update the ferrox dashboard in Grafana")
    g.add_argument("--url", required=True)
    g.add_argument("--token")
    g.add_argument("--user")
    g.add_argument("--password")
    g.add_argument("--folder")
    g.add_argument("--dashboard", help="dashboard JSON (default: the packaged ferrox dashboard)")
    g.set_defaults(func=_grafana)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(ns.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
