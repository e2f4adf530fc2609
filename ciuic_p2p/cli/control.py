"""The CLI commands that talk to the running daemon over its control socket:
``join``, ``leave``, ``status``, ``peers``, ``routes``, ``store put|get|ls|rm``, and
those serf's and consul's users reach for: ``members``, ``monitor``, ``force-leave``,
``rtt``, ``reload`` and ``runs``.

Each takes ``--json`` (one JSON object on stdout; a failure is ``{"ok": false,
"error": ...}``; ``monitor --json`` prints one object per line) and finds the socket
from ``--control``, ``--state-dir``, or the config (``--config``, ``$CIUIC_CONFIG``):
``control.sock`` in ``node.runtime_dir``. A daemon's error exits 1, one that says the
request was the mistake (``user_error``: an unknown or live member to force out,
another writer's object to remove) exits 2, like the CLI's own mistakes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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

CONTROL_COMMANDS = ("join", "leave", "status", "peers", "routes", "store", "members",
                    "monitor", "force-leave", "rtt", "reload", "runs")  # fmt: skip


def add_socket_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--control", help="control socket (default RUNTIME_DIR/control.sock)")
    cmd.add_argument("--state-dir", help="the daemon's state directory (its control.sock)")
    cmd.add_argument("--config", help="TOML config file, for node.runtime_dir")


COMMANDS = (
    ("join", "make the running daemon join a mesh through HOST:PORT", ""),
    ("leave", "make the running daemon leave the mesh gracefully and exit", ""),
    ("status", "show the running daemon: service state, members, counters", ""),
    ("peers", "list the members the running daemon knows: state, address, RTT", ""),
    ("routes", "show the running daemon's routes: direct or relayed, and RTTs", ""),
    (
        "members",
        "list every member, this node included (marked *): state, address, RTT, name",
        "Every member the running daemon knows, this node first and marked with *: "
        "its name, state (alive, suspect, dead, left), address, RTT and peer ID.",
    ),
    (
        "monitor",
        "follow the running daemon's events live (members, trainers, store, reloads)",
        "Print each event the running daemon logs as it happens: members joining, "
        "suspected, dead or left; trainers attaching and leaving; store puts and "
        "removals; reloads; the daemon's own leave. Every event at info level or above "
        "whatever the daemon's --log-level. Ends on Ctrl+C, when the daemon stops, or "
        "after --count events or --for-s seconds. A monitor that reads too slowly "
        "loses the oldest events, and says how many.",
    ),
    (
        "force-leave",
        "take a failed (dead) member as departed: no longer probed or listed as failed",
        "Mark a member that failed (state dead) as left, now, on this node: it is no "
        "longer reconnected to, gossiped to or shown as failed, and is forgotten with "
        "the departed. Only this node's view changes (a departure is the member's own "
        "signed word; each node forces its own). A member that is alive or suspected, "
        "or unknown here, is refused (exit 2). A member forced out that comes back is "
        "taken back.",
    ),
    (
        "rtt",
        "show the RTT to NODE (or between NODE and OTHER): measured and by coordinates",
        "The round-trip time from this node to NODE, or between NODE and OTHER as "
        "this node's map has it: measured by probes here, published by the members, "
        "and the Vivaldi coordinates' estimate.",
    ),
    (
        "reload",
        "reload the running daemon's config, as SIGHUP does; say what changed",
        "Have the running daemon re-read its config file and environment, exactly as "
        "SIGHUP does: the log settings, join seeds and revocation list apply at once; "
        "a changed setting that needs a restart is named. Prints the reload count and "
        "what changed.",
    ),
    (
        "runs",
        "list the training runs the running daemon knows and their replicas",
        "The training runs this daemon has seen: its own trainer's and those its "
        "peers' chunks name. For each run its replicas (member daemons), their newest "
        "step seen here, and whether they are live, ended or gone.",
    ),
)


def add_control_commands(sub: Any) -> None:
    for name, text, description in COMMANDS:
        cmd = sub.add_parser(name, help=text, description=description or text)
        if name == "join":
            cmd.add_argument("address", metavar="HOST:PORT", help="any member of the mesh")
        if name in ("force-leave", "rtt"):
            cmd.add_argument("node", metavar="NODE", help="a member's node name or peer ID")
        if name == "rtt":
            cmd.add_argument(
                "other",
                metavar="OTHER",
                nargs="?",
                default="",
                help="another member: the RTT between NODE and it (default: this node)",
            )
        if name == "monitor":
            cmd.add_argument("--json", action="store_true", help="print each event as a JSON line")
            cmd.add_argument(
                "--count", type=int, metavar="N", help="stop after N events (for scripts)"
            )
            cmd.add_argument(
                "--for-s", type=float, metavar="S", help="stop after S seconds (for scripts)"
            )
        else:
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
    if command == "monitor":
        return _monitor(path, args)
    timeout_s = 30.0
    if command == "store":
        body = _store_request(args)
        timeout_s = 300.0
    elif command == "join":
        body = {"cmd": "join", "address": args.address}
    elif command in ("leave", "routes", "members", "reload", "runs"):
        body = {"cmd": command}
    elif command == "force-leave":
        body = {"cmd": "force_leave", "node": args.node}
    elif command == "rtt":
        body = {"cmd": "rtt", "node": args.node, "other": args.other}
    else:
        body = {"cmd": "status"}
    answer = request(path, body, timeout_s=timeout_s)
    if not answer.get("ok"):
        if args.json:
            print(json.dumps({"ok": False, "error": answer.get("error", "failed")}))
        print(f"ciuic-node: error: {answer.get('error', 'failed')}", file=sys.stderr)
        return 2 if answer.get("user_error") is True else 1
    if args.json:
        if command == "peers":
            answer = {"ok": True, "peer": answer["peer"], "members": answer["members"]}
        print(json.dumps(answer))
        return 0
    _print_answer(args, answer)
    return 0


def _store_request(args: argparse.Namespace) -> dict[str, Any]:
    if args.store_command == "ls":
        return {"cmd": "store_ls"}
    if args.store_command == "rm":
        return {"cmd": "store_rm", "name": args.name}
    path_arg = str(Path(args.file).resolve())
    if args.store_command == "put":
        return {"cmd": "store_put", "name": args.name, "path": path_arg, "local": args.local}
    return {"cmd": "store_get", "name": args.name, "path": path_arg,
            "min_version": args.min_version, "writer": args.writer}  # fmt: skip


def _print_answer(args: argparse.Namespace, answer: dict[str, Any]) -> None:
    command = args.command
    if command == "store":
        _print_store(args, answer)
    elif command == "join":
        print(f"joined through {args.address}: {answer['members']} members")
    elif command == "leave":
        print("leaving the mesh")
    elif command == "routes":
        _print_routes(answer)
    elif command == "peers":
        _print_peers(answer)
    elif command == "members":
        _print_members(answer)
    elif command == "force-leave":
        print(f"{_label(answer.get('name', ''), answer['peer'])}: {answer['state']} here")
    elif command == "rtt":
        _print_rtt(answer)
    elif command == "reload":
        _print_reload(answer)
    elif command == "runs":
        _print_runs(answer)
    else:
        _print_status(answer)


def _print_store(args: argparse.Namespace, answer: dict[str, Any]) -> None:
    if args.store_command == "get":
        writer = _safe(answer.get("writer") or "-")
        print(f"{args.name} version {answer['version']} written by {writer}")
    elif args.store_command == "put":
        held = ", ".join(answer.get("held_by") or []) or "-"
        print(f"{args.name} version {answer['version']} (held by {held})")
    elif args.store_command == "rm":
        print(f"{_safe(args.name)}: {answer['removed']} version(s) of this node's removed")
    else:
        if not answer["held"]:
            print("no objects held here")
        for h in answer["held"]:
            writer = "self" if h.get("own") else _safe(h["writer"])
            print(f"  {_safe(h['name']):<32} {writer:<24} v{h['version']:<8} {h['bytes']} bytes")


def _print_members(answer: dict[str, Any]) -> None:
    for m in answer["members"]:
        mark = "*" if m.get("self") else " "
        rtt = "-" if m["rtt_ms"] is None else f"{m['rtt_ms']:.1f} ms"
        name, address, peer = _safe(m.get("name") or "-"), _safe(m["address"]), _safe(m["peer"])
        print(f"{mark} {name:<20} {m['state']:<8} {address:<22} {rtt:>10}  {peer}")


def _print_rtt(answer: dict[str, Any]) -> None:
    a = _label(answer.get("from_name", ""), answer["from"])
    b = _label(answer.get("to_name", ""), answer["to"])
    shown = _ms(answer["rtt_ms"])
    print(f"{a} -> {b}: {shown} ({answer['rtt_source']})")
    probes = answer.get("probes")
    if probes:
        print(
            f"  probes: {probes['samples']} samples, smoothed {_ms(probes['smoothed_ms'])}, "
            f"min {_ms(probes['min_ms'])}, variance {_ms(probes['variance_ms'])}"
        )
    print(f"  vivaldi estimate: {_ms(answer.get('vivaldi_ms'))}")


def _print_reload(answer: dict[str, Any]) -> None:
    if answer.get("error"):
        print(f"reload {answer['reloads']} kept the old config: {answer['error']}")
        return
    changed = ", ".join(answer["changed"]) or "nothing"
    print(f"reload {answer['reloads']}: changed {changed}")
    if answer["needs_restart"]:
        print(f"  needs a restart to apply: {', '.join(answer['needs_restart'])}")


def _print_runs(answer: dict[str, Any]) -> None:
    if not answer["runs"]:
        trainer = "" if answer.get("serves_trainer") else " (this daemon serves no trainer)"
        print(f"no training runs known here{trainer}")
    for run in answer["runs"]:
        name = f" {_safe(run['name'])}" if run.get("name") else ""
        state = "live" if run["live"] else "ended"
        print(f"run {run['run'][:16]}{name}: {state}, {len(run['replicas'])} replica(s)")
        for r in run["replicas"]:
            step = "-" if r["step"] is None else str(r["step"])
            here = " (this node)" if r["local"] else ""
            print(f"  {_safe(r['peer'])}{here}  {r['state']:<9} step {step}")


def _monitor(path: Path, args: argparse.Namespace) -> int:
    """Follow the daemon's events until Ctrl+C, the daemon's stop, ``--count`` events
    or ``--for-s`` seconds."""
    from ciuic_p2p.daemon.control import ControlError, stream  # noqa: PLC0415

    if args.count is not None and args.count < 1:
        raise CiuicError("--count must be at least 1")
    if args.for_s is not None and not 0 < args.for_s <= 365 * 86400:
        raise CiuicError("--for-s must be a number of seconds above 0")
    until = None if args.for_s is None else time.monotonic() + args.for_s
    seen = 0
    lines = stream(path, {"cmd": "monitor"}, until=until)
    try:
        answer = next(lines, None)
        if answer is None:
            raise ControlError(f"{path}: the daemon gave no answer")
        if not answer.get("ok"):
            print(f"ciuic-node: error: {answer.get('error', 'failed')}", file=sys.stderr)
            return 1
        for event in lines:
            if args.json:
                print(json.dumps(event), flush=True)
            else:
                print(_event_line(event), flush=True)
            seen += 1
            if args.count is not None and seen >= args.count:
                break
        else:
            if until is None or time.monotonic() < until:
                print("ciuic-node: the daemon stopped", file=sys.stderr)
    except KeyboardInterrupt:  # Ctrl+C: what the user wanted, not a failure
        pass
    finally:
        lines.close()
    return 0


def _event_line(event: dict[str, Any]) -> str:
    """An event as one line a person reads: time, level, name, then its fields."""
    at = str(event.get("at", ""))[11:23]
    skip = ("at", "level", "event", "logger", "timestamp")
    fields = " ".join(f"{_safe(k)}={_safe(v)}" for k, v in event.items() if k not in skip)
    return f"{at} {event.get('level', '')!s:<7} {_safe(event.get('event', ''))} {fields}"


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
    """``peers``: the members other than this node (its shape is kept for scripts)."""
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
