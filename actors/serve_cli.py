"""`pagedweight serve MODEL_DIR`: the OpenAI-compatible Ray Serve app on a local or existing Ray cluster.

Binds 127.0.0.1 unless --host says otherwise. A HF checkpoint is converted to any-precision planes
first (cached, as `pagedweight run` does) unless --dense. One engine replica per GPU by default.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

from pagedweight.cli import HelpFormatter

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (Ray Serve)",
        description="Start (or join, with --address) a Ray cluster and run the OpenAI-compatible app: "
                    "/v1/models, /v1/completions, /v1/chat/completions (streaming and not), /tokenize, /detokenize, "
                    "/health. Blocks until Ctrl-C.",
        formatter_class=HelpFormatter)
    p.add_argument("model_dir", metavar="MODEL", help="AP checkpoint or HF checkpoint directory, or a Hugging Face Hub "
                                                      "repository id (fetched into the Hub's cache)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name requests give as \"model\" (default: the repository id, or the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000, help="TCP port of the HTTP server")
    p.add_argument("--api-key", default=None,  # not the environment's key as a default: --help would print it
                   help="require 'Authorization: Bearer KEY' (default: $PAGEDWEIGHT_API_KEY; none = open)")
    p.add_argument("--gpu-memory-budget", default=None, metavar="BYTES",
                   help="per engine, weights + KV cache: bytes with unit (40GiB) or a fraction of device memory")
    p.add_argument("--num-replicas", type=int, default=None,
                   help="engine replicas (default: one per GPU of the cluster, 1 without GPUs)")
    p.add_argument("--no-prefix-affinity", dest="prefix_affinity", action="store_false",
                   help="route requests with Serve's default router (power of two choices) instead of by prefix "
                        "affinity under a load bound (a conversation's turns to the replica holding its KV blocks)")
    p.add_argument("--gpus-per-replica", type=float, default=None, metavar="N",
                   help="GPUs of each engine replica, 0 for CPU engines (default: 1 if the cluster has GPUs now, else "
                        "0; give 1 to join an autoscaling cluster whose GPU nodes are still at zero)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS or a new local one); MODEL must then be a path that "
                        "every node reads (a shared or synced directory): converted and Hub checkpoints go to this "
                        "machine's --cache-dir")
    p.add_argument("--dense", action="store_true", help="serve the HF checkpoint's dense weights (no planes)")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "pagedweight"),
                   help="where converted AP checkpoints are kept")
    p.add_argument("--engine-options", default="{}", metavar="JSON",
                   help="extra LLM engine options (pagedweight.engine.EngineOptions), "
                        "e.g. '{\"prefix_retention_s\": 5}'")
    return p


def failed_deployment_messages(app: str = "pagedweight") -> str:
    """The status messages of `app`'s deployments that failed to deploy, joined ("" if Serve cannot say). Ray 2.60's
    error for a deployment whose replicas failed to start names only the deployment ("Failed to update the
    deployments ['EngineReplica']."); the replica's traceback is in the deployment's own status message."""
    from ray import serve

    try:
        status = serve.status().applications.get(app)
    except Exception:  # noqa: BLE001 - the controller gone: the app's own message is all there is
        return ""
    if status is None:
        return ""
    return "\n".join(d.message for d in status.deployments.values()
                     if d.message and getattr(d.status, "value", d.status) == "DEPLOY_FAILED")


def deploy_error(exc: RuntimeError, details: str = "") -> RuntimeError | ValueError:
    """Serve's "Deploying application ... failed: <message>", with `details` (`failed_deployment_messages`: where
    Ray 2.60 keeps the replica's whole traceback): a ValueError of the last exception line there, the one that
    stopped the engine (a budget too small, a bad checkpoint), which the CLI prints as one line; any other
    RuntimeError as it is."""
    text = str(exc)
    if not text.startswith("Deploying application") or " failed" not in text:
        return exc
    lines = [line.strip() for line in f"{text}\n{details}".splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b[^:]*: ", line)]
    cause = raised[-1] if raised else lines[0].split(" failed: ", 1)[-1]
    return ValueError(f"the engine replicas failed to start: {cause} (the whole traceback is in the Serve "
                      "controller's log: logs/serve/ in the Ray session's directory, /tmp/ray/session_latest on "
                      "the head node by default)")


def replicas_short(replicas: int, actor_options: dict, total: dict) -> list[str]:
    """The resources that `replicas` engine replicas of `actor_options` ask beyond the cluster's `total` now."""
    return [f"{replicas} x {need:g} {name} > {total.get(name, 0.0):g}"
            for name, need in (("GPU", actor_options["num_gpus"]), ("CPU", actor_options["num_cpus"]))
            if need and replicas * need > total.get(name, 0.0) + 1e-9]


def check_port_free(host: str, port: int) -> None:
    """Refuse a port this machine cannot listen on at `host` (in use, or an address it does not have), as Serve's
    proxy binds it (SO_REUSEADDR, as uvicorn: a closed connection's TIME_WAIT does not count)."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ValueError(f"--port {port}: {host}:{port} {why}") from None


def run(args) -> int:
    import ray
    import torch
    from loguru import logger
    from ray import serve

    from pagedweight.actors.engine_actor import engine_options_json
    from pagedweight.actors.openai_app import AppArgs, build_app, engine_actor_options
    from pagedweight.checkpoint import model_name, resolve_model
    from pagedweight.convert import ap_checkpoint_for
    from pagedweight.pool import parse_budget

    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port}: not a TCP port")
    if args.num_replicas is not None and args.num_replicas < 1:
        raise ValueError("--num-replicas must be >= 1")
    if args.gpus_per_replica is not None and not 0 <= args.gpus_per_replica <= 1:
        raise ValueError("--gpus-per-replica must be in [0, 1] (an engine runs on one device)")
    own_cluster = args.address is None and not os.environ.get("RAY_ADDRESS")
    if own_cluster:  # Serve's proxy binds it on this machine: refused now, not after a conversion and Ray's start
        check_port_free(args.host, args.port)
    options = engine_options_json(args.engine_options)
    api_key = args.api_key or os.environ.get("PAGEDWEIGHT_API_KEY")
    budget = parse_budget(args.gpu_memory_budget) if args.gpu_memory_budget else None
    if args.host not in LOOPBACK and not api_key:
        logger.warning("serving on {} without an API key: anyone who can reach the port can use it", args.host)
    model_dir, name = resolve_model(args.model_dir), args.served_model_name or model_name(args.model_dir)
    if not args.dense:
        model_dir = ap_checkpoint_for(model_dir, Path(args.cache_dir), "cuda" if torch.cuda.is_available() else "cpu")
    ray.init(address=args.address, namespace="pagedweight")
    replicas = args.num_replicas or max(1, int(ray.cluster_resources().get("GPU", 0)))
    app_args = AppArgs(model_dir=str(model_dir.resolve()), num_replicas=replicas, gpu_memory_budget=budget,
                       api_key=api_key, engine_options={"served_model_name": name, **options},
                       prefix_affinity=args.prefix_affinity, num_gpus_per_replica=args.gpus_per_replica)
    if not own_cluster and len(ray.nodes()) > 1:
        logger.warning("engine replicas on other nodes open {} at that path: it must be there too", app_args.model_dir)
    short = replicas_short(replicas, engine_actor_options(app_args), ray.cluster_resources())
    if short and own_cluster:  # Serve would wait forever for replicas this machine cannot place
        raise ValueError(f"--num-replicas {replicas}: the engine replicas need {', '.join(short)} (this machine's "
                         "Ray cluster); ask fewer, or join a larger cluster with --address")
    if short:
        logger.warning("{} engine replicas need {}: the deploy waits until the cluster has them (an autoscaling "
                       "cluster adds nodes for pending replicas)", replicas, ", ".join(short))
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(build_app(app_args), name="pagedweight", route_prefix="/")
        except RuntimeError as exc:
            raise deploy_error(exc, failed_deployment_messages()) from exc
        print(f"serving {name} ({replicas} engine replica(s)) at http://{args.host}:{args.port}/v1 "
              "- Ctrl-C stops", flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:  # Ctrl-C, or an app that failed to deploy
        if not own_cluster:  # a joined cluster may serve other applications: only this one goes
            serve.delete("pagedweight")
        else:  # nobody else maps this cluster's page stores: give /dev/shm back
            serve.shutdown()
            from pagedweight.actors.page_store_actor import page_store_for_node

            ray.get(page_store_for_node().destroy.remote())
    return 0
