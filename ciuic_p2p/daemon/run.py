"""``ciuic-node run``: build the config (file, environment, flags), load the
credentials, start the parts and hand them to daemon.service (join, ready, reload on
SIGHUP, clean stop on SIGTERM/SIGINT or ``leave``).

Credentials default to files in the state directory: ``node.key`` (``ciuic-node
keygen``), ``node.pem`` (``ciuic-node ca issue``) and ``ca.pem`` (the cluster CA's
certificate), with ``revoked.pem`` if present. A missing or unreadable one is an error
naming the file and the command that makes it.

For tests and benchmarks, ``--emulate SCENARIO --emulate-node NAME --emulate-ports
BASE --emulate-start T`` puts the node behind the WAN emulator: node i of the scenario
listens on 127.0.0.1:BASE+i and every datagram is shaped by the scenario's links.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import fcntl
import os
import shlex
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ciuic_p2p.addresses import format_address, parse_address
from ciuic_p2p.admission import Trust, load_certificate, load_crl
from ciuic_p2p.config import (
    Config,
    WebSection,
    load_layered,
    runtime_dir,
    trainer_socket_path,
)
from ciuic_p2p.daemon.assembly import NodeAssembly
from ciuic_p2p.daemon.service import NodeService
from ciuic_p2p.daemon.web import page_announcement
from ciuic_p2p.errors import AdmissionError, CiuicError, ConfigError, TransientError
from ciuic_p2p.guard import install_loop_handler
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.logsetup import announce, configure_logging, get_logger
from ciuic_p2p.transport.loop import new_event_loop

log = get_logger("ciuic.daemon")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (default: the WAN preset)")
    p.add_argument("--listen", help="HOST:PORT to listen on (node.listen_host/port)")
    p.add_argument(
        "--advertise",
        metavar="HOST",
        help="address other members dial to reach this node (node.advertise_host); "
        "needed with a wildcard --listen such as 0.0.0.0",
    )
    p.add_argument("--name", help="node name shown in logs and status (node.name)")
    p.add_argument("--region", help="region label, e.g. aws:eu-central-1 (node.region)")
    p.add_argument("--state-dir", help="state directory (node.state_dir)")
    p.add_argument("--key", help="node key file (default STATE_DIR/node.key)")
    p.add_argument("--cert", help="node certificate (default STATE_DIR/node.pem)")
    p.add_argument("--ca", help="cluster CA certificate (default STATE_DIR/ca.pem)")
    p.add_argument("--crl", help="revocation list (default STATE_DIR/revoked.pem if present)")
    p.add_argument(
        "--join",
        metavar="HOST:PORT",
        help="join the mesh through this member (retried while it does not answer; "
        "an address that is not HOST:PORT exits 2)",
    )
    p.add_argument(
        "--control", help="control socket path (default control.sock in node.runtime_dir)"
    )
    p.add_argument(
        "--trainer-socket",
        metavar="PATH",
        help="where the trainer hook connects (train.socket_path, default "
        "STATE_DIR/trainer.sock); 'none' serves no trainer",
    )
    p.add_argument(
        "--web-port",
        type=int,
        metavar="PORT",
        help="status page and metrics port (web.port, default 7947; 0 picks a free one, "
        "printed at start: for a second daemon on this host). A port given here, in "
        "the config or the environment that is taken stops the daemon; the default "
        "one taken leaves it without a page, said at start and in status",
    )
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        help="lowest level logged (log.level, default info)",
    )
    p.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        help="log output: JSON lines, readable console lines, or auto: JSON unless "
        "stderr is a terminal (log.format)",
    )
    p.add_argument("--emulate", metavar="SCENARIO", help=argparse.SUPPRESS)
    p.add_argument("--emulate-node", help=argparse.SUPPRESS)
    p.add_argument("--emulate-ports", type=int, help=argparse.SUPPRESS)
    p.add_argument("--emulate-start", type=float, help=argparse.SUPPRESS)
    p.add_argument("--emulate-nodes", help=argparse.SUPPRESS)
    p.add_argument("--emulate-rate-scale", type=float, help=argparse.SUPPRESS)
    p.add_argument("--emulate-loss", type=float, help=argparse.SUPPRESS)


def build_config(args: argparse.Namespace) -> Config:
    """The config file (``--config``, else ``$CIUIC_CONFIG``), ``CIUIC_*`` environment
    variables over it, then the flags."""
    path = args.config or os.environ.get("CIUIC_CONFIG") or None
    config = load_layered(path, os.environ)
    node = config.node
    changes: dict[str, Any] = {}
    if args.listen:
        try:
            host, port = parse_address(args.listen, any_port=True)
        except ValueError as exc:
            raise ConfigError(f"--listen: {exc}") from None
        changes |= {"listen_host": host, "listen_port": port}
    if args.join:
        try:  # retried forever otherwise: no address of this shape can ever answer
            parse_address(args.join)
        except ValueError as exc:
            raise ConfigError(f"--join: {exc}; give a member's HOST:PORT") from None
    if args.advertise:
        changes["advertise_host"] = args.advertise
    for flag, key in (("name", "name"), ("region", "region"), ("state_dir", "state_dir")):
        if getattr(args, flag):
            changes[key] = getattr(args, flag)
    train = config.train
    if args.trainer_socket:
        train = dataclasses.replace(train, socket_path=args.trainer_socket)
    web = config.web
    if args.web_port is not None:
        if not 0 <= args.web_port <= 65535:
            raise ConfigError(f"--web-port: must be in [0, 65535], got {args.web_port}")
        web = dataclasses.replace(web, port=args.web_port)
    log_section = config.log
    if args.log_level or args.log_format:
        log_section = dataclasses.replace(
            log_section,
            level=args.log_level or log_section.level,
            format=args.log_format or log_section.format,
        )
    return dataclasses.replace(
        config, node=dataclasses.replace(node, **changes), train=train, web=web, log=log_section
    )


def _credential(path: str | None, default: Path, what: str, how: str) -> Path:
    p = Path(path) if path else default
    if not p.exists():
        raise CiuicError(f"no {what} at {p}: {how}")
    return p


def load_credentials(
    args: argparse.Namespace, state_dir: Path
) -> tuple[NodeKey, x509.Certificate, Trust]:
    key_path = Path(args.key) if args.key else state_dir / "node.key"
    key = NodeKey.load(
        _credential(
            args.key,
            state_dir / "node.key",
            "node key",
            f"create one with `ciuic-node keygen --out {shlex.quote(str(key_path))}`",
        )
    )
    cert = load_certificate(
        _credential(
            args.cert,
            state_dir / "node.pem",
            "node certificate",
            "have the cluster CA run `ciuic-node ca issue`",
        )
    )
    ca = load_certificate(
        _credential(
            args.ca,
            state_dir / "ca.pem",
            "cluster CA certificate",
            "copy the cluster's ca.pem there",
        )
    )
    crl_path = Path(args.crl) if args.crl else state_dir / "revoked.pem"
    crl = load_crl(crl_path) if crl_path.exists() else None
    if raw_public_key_of(cert) != key.public_key:
        raise CiuicError(
            "the node certificate was issued for another key than the node key: "
            "issue one for this key (`ciuic-node ca issue --key <node.key>`)"
        )
    trust = Trust(ca, crl)
    cert_path = args.cert or state_dir / "node.pem"
    try:  # at start, not at the first join: every peer would refuse it anyway
        trust.verify(cert, dt.datetime.now(dt.UTC))
    except AdmissionError as exc:
        ca_path = args.ca or state_dir / "ca.pem"
        raise CiuicError(
            f"this node's certificate {cert_path} fails against the cluster CA {ca_path}: "
            f"{exc}; issue one with this CA (`ciuic-node ca issue`)"
        ) from None
    return key, cert, trust


def raw_public_key_of(cert: x509.Certificate) -> bytes | None:
    public = cert.public_key()
    if not isinstance(public, Ed25519PublicKey):
        return None
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def lock_state_dir(state_dir: Path) -> int:
    """Hold an exclusive lock on the state directory for the daemon's lifetime (the
    descriptor stays open): a second daemon on it stops before touching anything."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CiuicError(f"{state_dir}: another ciuic-node daemon is running on it") from None
    return fd


def _emulated_wrapper(args: argparse.Namespace) -> Any:
    from ciuic_p2p.data import scenario_path  # noqa: PLC0415
    from ciuic_p2p.emulator.mesh import EmulatedMesh  # noqa: PLC0415
    from ciuic_p2p.emulator.scenarios import load_scenario  # noqa: PLC0415

    path = Path(args.emulate) if Path(args.emulate).exists() else scenario_path(args.emulate)
    overrides: dict[str, Any] = {}
    if args.emulate_rate_scale:
        overrides["rate_scale"] = args.emulate_rate_scale
    scenario = load_scenario(path, **overrides)
    if args.emulate_nodes:
        scenario = scenario.subset(args.emulate_nodes.split(","))
    if args.emulate_loss is not None:  # every link's random loss, for benchmarks
        links = {k: v.with_changes(loss=args.emulate_loss) for k, v in scenario.links.items()}
        scenario = dataclasses.replace(scenario, links=links)
    emulated = EmulatedMesh(scenario, start=args.emulate_start)
    for i, name in enumerate(scenario.node_names()):
        emulated.register(name, ("127.0.0.1", args.emulate_ports + i))
    return emulated.wrapper(args.emulate_node)


async def serve(args: argparse.Namespace) -> int:
    config = build_config(args)
    state_dir = Path(config.node.state_dir)
    key, cert, trust = load_credentials(args, state_dir)
    lock_state_dir(state_dir)
    sockets = runtime_dir(config)
    sockets.mkdir(parents=True, exist_ok=True)
    wrap = _emulated_wrapper(args) if args.emulate else None
    serves_trainer = config.train.socket_path != "none"
    trainer_path = trainer_socket_path(config) if serves_trainer else None
    node = NodeAssembly(
        config,
        key,
        cert,
        trust,
        state_dir=state_dir,
        wrap_udp=wrap,
        trainers=serves_trainer,
        trainer_socket=trainer_path,
    )
    daemon = node.daemon
    # Whatever asyncio reports (an exception in a callback, a task's unretrieved one) is
    # counted and logged by the daemon's guard: the daemon exits only by decision.
    install_loop_handler(asyncio.get_running_loop(), daemon.guard)
    try:
        address = await node.start()
    except OSError as exc:
        where = f"{config.node.listen_host}:{config.node.listen_port}"
        raise TransientError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CiuicError(str(exc)) from None
    await node.start_control(Path(args.control) if args.control else sockets / "control.sock")
    if trainer_path is not None:
        try:
            await node.start_trainers()
        except (OSError, CiuicError) as exc:
            await node.close()
            raise CiuicError(f"trainer socket {trainer_path}: {exc}") from None
    if config.audit.enabled:
        node.open_audit()
    if config.web.enabled:
        explicit = args.web_port is not None or config.web.port != WebSection().port
        await _start_web(node, sockets / "web.token", required=explicit)
    announce(
        log, "listening", f"{daemon.peer_id} listening on {address}", peer=daemon.peer_id,
        address=address,
    )  # fmt: skip
    crl_path = Path(args.crl) if args.crl else state_dir / "revoked.pem"
    service = NodeService(config, node, reload_config=lambda: build_config(args), crl_path=crl_path)
    node.service = service  # its section of the status
    return await service.run([args.join] if args.join else [])


async def _start_web(node: NodeAssembly, token_path: Path, *, required: bool) -> None:
    """The page and metrics. On a port the operator chose (``--web-port``, the config
    or the environment) a failure stops the daemon: they asked for that port and
    would look for the page there. On the default port, metrics are not worth
    refusing to train for: the daemon says so loudly, in ``status`` too, and runs on."""
    web = node.config.web
    try:
        port = await node.start_web(token_path)
    except OSError as exc:
        where = f"{web.listen_host}:{web.port}"
        error = (
            f"cannot listen on {where}: {exc.strerror or exc} (another daemon on this "
            "host? give this one --web-port PORT, 0 for any free port)"
        )
        if required:
            await node.close()
            raise CiuicError(f"web: {error}") from None
        log.error("web_unavailable", error=error)
        node.web_status = {"error": error}
        return
    assert node.web is not None
    url = f"http://{format_address(web.listen_host, port)}/"
    # Over the control socket (0600): only the daemon's own user sees the token here;
    # its group reads it from the file.
    node.web_status = {
        "url": url,
        "page": f"{url}#token={node.web.token}",
        "token_file": str(token_path),
    }
    text, fields = page_announcement(url, node.web.token, token_path)
    announce(log, "web_started", text, **fields)  # the token in a terminal only


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    configure_logging(config.log)
    loop = new_event_loop()
    try:
        return loop.run_until_complete(serve(args))
    finally:
        loop.close()
