"""The deploy/ serve configs and the `ferrox serve` command, for real.

The YAMLs are validated by Ray Serve's own schema and by ferrox's AppArgs,
and built into Serve applications; `ferrox serve` is started as a user would
start it (a subprocess that starts its own local Ray), answers the `openai`
client, and stops cleanly on Ctrl-C (SIGINT).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["deploy/serve.yaml", "deploy/serve-gpu.yaml"]


@pytest.mark.parametrize("path", CONFIGS)
def test_each_serve_config_validates_under_serves_schema_and_app_args(path):
    from ray.serve.schema import ServeDeploySchema

    from ferrox.cluster.config import AppArgs

    data = yaml.safe_load((ROOT / path).read_text())
    schema = ServeDeploySchema.model_validate(data) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(data)
    assert [a.import_path for a in schema.applications] == ["ferrox.cluster.app:build_app"]
    args = AppArgs.model_validate(data["applications"][0]["args"])
    assert args.model == "SmolLM2-135M-Instruct"


def test_the_cpu_config_runs_two_replicas_on_a_cpu_share_each():
    from ferrox.cluster.app import build_app, replica_deployment_options
    from ferrox.cluster.config import AppArgs

    data = yaml.safe_load((ROOT / "deploy/serve.yaml").read_text())
    args = AppArgs.model_validate(data["applications"][0]["args"])
    options = replica_deployment_options(args)
    assert options["num_replicas"] == 2
    assert options["ray_actor_options"] == {"num_cpus": 1}
    assert options["request_router_config"].request_routing_stats_period_s == 0.5
    assert type(build_app(args)).__name__ == "Application"


def test_the_gpu_config_autoscales_one_gpu_per_replica():
    from ferrox.cluster.app import replica_deployment_options
    from ferrox.cluster.config import AppArgs

    data = yaml.safe_load((ROOT / "deploy/serve-gpu.yaml").read_text())
    args = AppArgs.model_validate(data["applications"][0]["args"])
    options = replica_deployment_options(args)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 48}
    assert options["ray_actor_options"]["num_gpus"] == 1
    assert args.engine.device == "cuda"


def test_bad_args_are_refused_naming_the_key():
    from pydantic import ValidationError

    from ferrox.cluster.app import build_app

    with pytest.raises(ValidationError, match="page_sise"):
        build_app({"engine": {"page_sise": 16}})
    with pytest.raises(ValidationError, match="min_replicas"):
        build_app({"autoscaling_config": {"min_replicas": 5, "max_replicas": 2}})
    with pytest.raises(ValidationError, match="not both"):
        build_app({"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_serve(tmp_path, port: int, **engine) -> subprocess.Popen:
    """`ferrox serve` on deploy/serve.yaml (one replica, 64 MiB of KV, no CPU
    reservation, ``engine`` overrides) in its own process group, as a terminal
    would start it."""
    config = tmp_path / "serve.yaml"
    data = yaml.safe_load((ROOT / "deploy/serve.yaml").read_text())
    data["applications"][0]["args"]["engine"].update(kv_cache_bytes=64 << 20, **engine)
    data["applications"][0]["args"]["ray_actor_options"] = {"num_cpus": 0}
    config.write_text(yaml.safe_dump(data))
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    ferrox = Path(sys.executable).with_name("ferrox")
    return subprocess.Popen(
        [str(ferrox), "serve", "--config", str(config), "--replicas", "1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
        start_new_session=True,
    )


def _read_until(proc: subprocess.Popen, marker: str, timeout_s: float = 240) -> str:
    """Its output up to and including the first line holding ``marker`` (or all of it, if it ends first)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            break
    return "".join(lines)


def _stop(proc: subprocess.Popen, signum: int, *, group: bool = False) -> str:
    """Send ``signum`` (to its whole group with ``group``); the rest of its output once it exits."""
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    try:
        rest, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
    return rest or ""


def test_ferrox_serve_starts_answers_and_stops_on_ctrl_c(tmp_path):
    import openai

    port = _free_port()
    # float32: the answer below is a near tie for SmolLM2 (0.08 logits
    # between "The" and "L" in float32), which bfloat16 rounding can flip.
    proc = _start_serve(tmp_path, port, dtype="float32")
    try:
        out = _read_until(proc, "Ctrl-C to stop")
        assert f"http://127.0.0.1:{port}/v1" in out, out[-3000:]
        assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in out
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content
    finally:
        rest = _stop(proc, signal.SIGINT)
    assert proc.returncode == 0, rest[-3000:]
    assert ">> stopped" in rest


def test_ctrl_c_while_the_replicas_deploy_stops_ferrox_serve(tmp_path):
    proc = _start_serve(tmp_path, _free_port())
    try:
        out = _read_until(proc, ">> deploying")
        assert ">> deploying" in out, out[-3000:]
    finally:
        rest = _stop(proc, signal.SIGINT)
    assert proc.returncode == 130, rest[-3000:]
    assert ">> interrupted while deploying; shutting down" in rest and ">> stopped" in rest
    assert "Ctrl-C to stop" not in rest, "it never reported serving"


def test_ferrox_serve_refuses_a_port_that_is_already_taken(tmp_path):
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    ferrox = Path(sys.executable).with_name("ferrox")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [str(ferrox), "serve", "--config", str(ROOT / "deploy/serve.yaml"), "--port", str(port)],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
        )
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        f"error: cannot serve on 127.0.0.1:{port}: Address already in use (pick another with --port)"
    )


def test_sigterm_to_the_whole_process_group_stops_ferrox_serve_promptly(tmp_path):
    """What `timeout`, `docker stop` or systemd send: Ray's own processes get
    it too. It used to wait a minute on the half-dead cluster and exit 1."""
    proc = _start_serve(tmp_path, _free_port())
    try:
        out = _read_until(proc, "Ctrl-C to stop")
        assert "Ctrl-C to stop" in out, out[-3000:]
    finally:
        rest = _stop(proc, signal.SIGTERM, group=True)
    # A shutdown that hangs is cut at 30 s with exit 1 and "did not finish".
    assert proc.returncode == 0, rest[-3000:]
    assert ">> stopped" in rest and "did not finish" not in rest
