"""The CLI commands that talk to the running daemon over its control socket:
``join``, ``leave``, ``status``, ``peers``, ``routes`` and ``store put|get``.

Each takes ``--json`` (one JSON object on stdout; a failure is ``{"ok": false,
"error": ...}``) and finds the socket from ``--control``, ``--state-dir``, or the
config (``--config``, ``$CIUIC_CONFIG``): ``control.sock`` in ``node.runtime_dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from ciuic_p2p.config import Config
from ciuic_p2p.config.locate import (
    first_present,
    node_config_file,
    not_found_hint,
    socket_candidates,
)
from ciuic_p2p.errors import CiuicError

CONTROL_COMMANDS = ("join", "leave", "status", "peers", "routes", "store")


def add_socket_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--control", help="control socket (default RUNTIME_DIR/control.sock)")
    cmd.add_argument("--state-dir", help="the daemon's state directory (its control.sock)")
    cmd.add_argument("--config", help="TOML config file, for node.runtime_dir")


def add_control_commands(sub: Any) -> None:
    for name, text in (
        ("join", "make the running daemon join a mesh through HOST:PORT"),
        ("leave", "make the running daemon leave the mesh gracefully and exit"),
        ("status", "show the running daemon: service state, members, counters"),
        ("peers", "list the members the running daemon knows: state, address, RTT"),
        ("routes", "show the running daemon's routes: direct or relayed, and RTTs"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        if name == "join":
            cmd.add_argument("address", metavar="HOST:PORT", help="any member of the mesh")
        cmd.add_argument("--json", action="store_true", help="print JSON")
        add_socket_arguments(cmd)


def control_path(args: argparse.Namespace) -> Path:
    """``--control``; ``--state-dir``; else ``control.sock`` where config.locate finds
    it, the config (``--config``, ``$CIUIC_CONFIG`` or the service's) read leniently:
    an operator who broke the file must still reach the daemon that runs on the old
    one."""
    if args.control:
        return Path(args.control)
    if args.state_dir:
        return Path(args.state_dir) / "control.sock"
    env = os.environ
    config_file = node_config_file(args.config, env)
    named = bool(args.config or env.get("CIUIC_CONFIG"))
    candidates = socket_candidates(_sockets_of(config_file), "control.sock", named)
    found = first_present(candidates)
    if found is None:
        raise CiuicError(
            not_found_hint(
                candidates,
                "running daemon",
                "name the one you mean with --state-dir DIR (its state directory), "
                "--config FILE or --control SOCKET",
            )
        )
    return found


def _sockets_of(config_file: Path | None) -> Path:
    """The runtime directory the daemon of ``config_file`` (None: defaults) uses, the
    ``CIUIC_NODE_*`` variables over the file, reading only its ``node`` section."""
    node: dict[str, Any] = {}
    if config_file is not None:
        try:
            data = tomllib.loads(config_file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise CiuicError(f"{config_file}: cannot read: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise CiuicError(f"{config_file}: not valid TOML: {exc}") from None
        found = data.get("node")
        node = found if isinstance(found, dict) else {}
    env = os.environ
    chosen = (
        env.get("CIUIC_NODE_RUNTIME_DIR")
        or node.get("runtime_dir")
        or env.get("CIUIC_NODE_STATE_DIR")
        or node.get("state_dir")
        or Config().node.state_dir
    )
    return Path(str(chosen)).expanduser()


def steer(args: argparse.Namespace) -> int:
    from ciuic_p2p.daemon.control import request  # noqa: PLC0415

    path = control_path(args)
    command = args.command
    if command == "store":
        path_arg = str(Path(args.file).resolve())
        if args.store_command == "put":
            body = {"cmd": "store_put", "name": args.name, "path": path_arg, "local": args.local}
        else:
            body = {"cmd": "store_get", "name": args.name, "path": path_arg,
                    "min_version": args.min_version, "writer": args.writer}  # fmt: skip
        answer = request(path, body, timeout_s=300)
    elif command == "join":
        answer = request(path, {"cmd": "join", "address": args.address})
    elif command in ("leave", "routes"):
        answer = request(path, {"cmd": command})
    else:
        answer = request(path, {"cmd": "status"})
    if not answer.get("ok"):
        if args.json:
            print(json.dumps({"ok": False, "error": answer.get("error", "failed")}))
        print(f"ciuic-node: error: {answer.get('error', 'failed')}", file=sys.stderr)
        return 1
    if args.json:
        if command == "peers":
            answer = {"ok": True, "peer": answer["peer"], "members": answer["members"]}
        print(json.dumps(answer))
    elif command == "store" and args.store_command == "get":
        writer = _safe(answer.get("writer") or "-")
        print(f"{args.name} version {answer['version']} written by {writer}")
    elif command == "store":
        held = ", ".join(answer.get("held_by") or []) or "-"
        print(f"{args.name} version {answer['version']} (held by {held})")
    elif command == "join":
        print(f"joined through {args.address}: {answer['members']} members")
    elif command == "leave":
        print("leaving the mesh")
    elif command == "routes":
        _print_routes(answer)
    elif command == "peers":
        _print_peers(answer)
    else:
        _print_status(answer)
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _print_status(status: dict[str, Any]) -> None:
    service = status.get("service") or {}
    print(
        f"{status['name']} {status['peer']} at {status['address']} "
        f"over QUIC ({status.get('quic_backend', 'aioquic')}) "
        f"(incarnation {status['incarnation']}, {status['alive']} alive, "
        f"{service.get('state', 'running')}, up {status['uptime_s']:.0f} s)"
    )
    if service.get("join_error"):
        print(f"  joining: {service['join_error']} (attempt {service['join_attempts']})")
    web = status.get("web") or {}
    if web:
        print(f"  status page: {web.get('page') or web.get('url') or web.get('error')}")
    audit = status.get("audit") or {}
    if audit:
        print(f"  audit log: {audit['dir']} (last entry {audit['last_seq']}, head {audit['head']})")
    if status.get("banned"):
        print(f"  banned (revoked while linked): {', '.join(status['banned'])}")
    if service.get("needs_restart"):
        print(f"  changed settings that need a restart: {', '.join(service['needs_restart'])}")
    _print_peers(status)
    counters = status.get("counters") or {}
    if counters:
        print("  " + ", ".join(f"{k} {v}" for k, v in sorted(counters.items())))


def _safe(text: object) -> str:
    """A member's word (its address, name, ID) as printable text: escapes shown, never
    sent to the terminal."""
    s = str(text)
    return s if s.isprintable() else s.encode("unicode_escape").decode("ascii")


def _label(name: str, peer: str) -> str:
    """A member as a person reads it: its name and the start of its peer ID."""
    return _safe(f"{name} ({peer[:12]})" if name else peer[:12])


def _print_peers(status: dict[str, Any]) -> None:
    names = {m["peer"]: m.get("name", "") for m in status["members"]}
    for m in status["members"]:
        rtt = "-" if m["rtt_ms"] is None else f"{m['rtt_ms']:.1f} ms ({m['rtt_source']})"
        hops = m["route"][1:-1]
        via = " via " + " > ".join(_label(names.get(p, ""), p) for p in hops) if hops else ""
        who = _label(m.get("name", ""), m["peer"])
        address, peer = _safe(m["address"]), _safe(m["peer"])
        print(f"  {who:<28} {m['state']:<8} {address:<22} {rtt}{via}  {peer}")


def _print_routes(answer: dict[str, Any]) -> None:
    for r in answer["routes"]:
        names = r.get("path_names") or [""] * len(r["path"])
        hops = " > ".join(_label(n, p) for n, p in zip(names, r["path"], strict=True))
        kind = "direct" if len(r["path"]) == 2 else f"relayed ({len(r['path']) - 2} hop)"
        to = _label(r.get("to_name", ""), r["to"])
        print(
            f"  {to:<28} {kind:<18} {_ms(r['path_rtt_ms']):>10} "
            f"(direct {_ms(r['direct_rtt_ms'])})  {hops}"
        )
