"""``ciuic-node``: the command-line entry point.

Subcommands arrive with the issues that implement them; each one answers ``--help``.
User mistakes end in one clear line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from ciuic_p2p import __version__
from ciuic_p2p.admission import ClusterCA, Trust, load_certificate, load_crl, write_pem
from ciuic_p2p.cli.control import CONTROL_COMMANDS, add_socket_arguments
from ciuic_p2p.config import ENV_PREFIX, SECTIONS, Config, load_layered
from ciuic_p2p.errors import AdmissionError, CiuicError, IdentityError, TransientError
from ciuic_p2p.identity import NodeKey, peer_id_of

TRAINING_MODULES = ("torch", "numpy")
"""What the `train` extra brings; the daemon and every command but ``demo`` run without."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ciuic-node",
        description=(
            "ciuic-p2p node daemon: trains one model across GPU nodes on slow, far links "
            "by exchanging sparse, low-bit quantized updates over authenticated QUIC."
        ),
    )
    parser.add_argument("--version", action="version", version=f"ciuic-node {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="what to do")

    keygen = command(
        sub,
        "keygen",
        "create a node key; print its peer ID and public key",
        "Create this node's Ed25519 key in a new file (mode 0600) and print its peer ID "
        "and its public key in hex, which the cluster CA's `ca issue --key` takes.",
    )
    keygen.add_argument("--out", required=True, help="key file to create (mode 0600)")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing file")

    ca = command(
        sub,
        "ca",
        "cluster CA: admit and remove nodes",
        "The cluster's certificate authority: create it, issue node certificates, "
        "revoke them. Keep the CA directory offline.",
    )
    ca_sub = ca.add_subparsers(
        dest="ca_command", metavar="ACTION", required=True, help="what to do with the CA"
    )
    ca_init = command(ca_sub, "init", "create a cluster CA (ca.key, ca.pem) in DIR")
    ca_init.add_argument("--dir", required=True, help="directory for the CA (keep it offline)")
    ca_init.add_argument("--cluster", required=True, help="cluster name")
    ca_issue = command(
        ca_sub,
        "issue",
        "issue a node certificate for a node key",
        "Issue a certificate that admits the node whose key is given (its key file, "
        "or the public key in hex that `keygen` printed: the node key need not leave "
        "its machine).",
    )
    ca_issue.add_argument("--dir", required=True, help="the CA directory")
    ca_issue.add_argument(
        "--key", required=True, help="the node's key file, or its public key in hex"
    )
    ca_issue.add_argument("--out", required=True, help="certificate file to write (PEM)")
    ca_issue.add_argument("--days", type=int, default=365, help="validity in days (365)")
    ca_revoke = command(ca_sub, "revoke", "add node certificates to the revocation list")
    ca_revoke.add_argument("--dir", required=True, help="the CA directory")
    ca_revoke.add_argument("certs", nargs="+", help="certificate files of the nodes to remove")
    ca_revoke.add_argument("--out", required=True, help="revocation list to write (PEM CRL)")

    run = command(
        sub,
        "run",
        "start the node daemon (joins a mesh with --join)",
        "Run the node daemon in the foreground: the config file, CIUIC_* variables and "
        "these flags, in that order of precedence from last to first; credentials from "
        "the state directory. SIGHUP (or `ciuic-node reload`) reloads, SIGTERM or "
        "Ctrl+C leaves the mesh cleanly.",
    )
    from ciuic_p2p.daemon.run import add_run_arguments  # noqa: PLC0415

    add_run_arguments(run)
    from ciuic_p2p.cli.control import add_control_commands  # noqa: PLC0415

    add_control_commands(sub)

    store = command(
        sub,
        "store",
        "the shared store: put, get, list and remove named objects",
        "The mesh's shared store, through the running daemon: each member holds named "
        "objects, each writer's versions apart from the others'.",
    )
    store_sub = store.add_subparsers(
        dest="store_command", metavar="ACTION", required=True, help="what to do"
    )
    put = command(store_sub, "put", "have the mesh hold FILE's bytes as NAME")
    put.add_argument("name", metavar="NAME", help="the object's name")
    put.add_argument("file", metavar="FILE", help="the file whose bytes to put")
    put.add_argument("--local", action="store_true", help="hold it on this node only")
    get = command(
        store_sub,
        "get",
        "fetch NAME into FILE: this node's version, else that of the name's first "
        "writer held here, else the newest of any writer",
    )
    get.add_argument("name", metavar="NAME", help="the object's name")
    get.add_argument("file", metavar="FILE", help="the file to write (replaced atomically)")
    get.add_argument(
        "--min-version", type=int, default=0, help="the oldest version to accept (0: any)"
    )
    get.add_argument(
        "--writer", default="", help="the version written by this member (node name or peer ID)"
    )
    ls = command(
        store_sub,
        "ls",
        "list the objects held on this node: name, writer, version, bytes",
        "List the objects this node holds, its own and those it holds for other "
        "writers: name, writer (`self` marks this node's), version and size.",
    )
    rm = command(
        store_sub,
        "rm",
        "drop this node's own versions of NAME held here",
        "Drop the versions of NAME that this node wrote from what it holds. Another "
        "writer's object cannot be removed from the mesh (nobody's key but its "
        "writer's speaks for it): asked for one, rm refuses and exits 2. Copies other "
        "members hold of this node's object stay theirs.",
    )
    rm.add_argument("name", metavar="NAME", help="the object's name")
    for cmd in (put, get, ls, rm):
        cmd.add_argument("--json", action="store_true", help="print JSON")
        add_socket_arguments(cmd)

    emulate = command(
        sub,
        "emulate",
        "start emulated nodes on a WAN scenario as processes, measure, tear down",
    )
    emulate.add_argument(
        "scenario", help="shipped scenario (cities11, multicloud8, harsh, partition) or a file"
    )
    emulate.add_argument("--nodes", type=int, default=0, help="first N nodes (0: all)")
    emulate.add_argument("--pings", type=int, default=5, help="pings per pair")
    emulate.add_argument("--json", action="store_true", help="print JSON")

    netem = command(
        sub,
        "netem",
        "run a scenario's nodes in network namespaces shaped by kernel netem (root)",
    )
    netem.add_argument("scenario", help="shipped scenario name or a file")
    netem.add_argument("--nodes", type=int, default=0, help="first N nodes (0: all)")
    netem.add_argument("--pings", type=int, default=5, help="pings per pair")
    netem.add_argument("--dry-run", action="store_true", help="print the ip/tc commands only")

    demo = command(
        sub,
        "demo",
        "train a model on N local nodes over the emulated 11-city WAN, beside a "
        "dense synchronous baseline; summary table and plot",
    )
    from ciuic_p2p.lab.demo import add_demo_arguments  # noqa: PLC0415

    add_demo_arguments(demo)

    audit = command(sub, "audit", "check the tamper-evident audit log")
    from ciuic_p2p.cli.audit import add_audit_arguments  # noqa: PLC0415

    add_audit_arguments(audit)

    config = command(sub, "config", "inspect configuration")
    config_sub = config.add_subparsers(
        dest="config_command", metavar="ACTION", required=True, help="what to do"
    )
    check = command(config_sub, "check", "validate a TOML config file and print it")
    check.add_argument("file", help="path of the TOML file")
    command(
        config_sub, "example", "print the annotated example config (every setting and its default)"
    )

    from ciuic_p2p.cli.completion import add_completion_command  # noqa: PLC0415

    add_completion_command(sub)
    return parser


def command(
    sub: Any, name: str, text: str, description: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` opens with ``description`` (by default its
    one-line ``text``, which the parent's ``--help`` lists)."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=text, description=description or text[:1].upper() + text[1:] + "."
    )
    return parser


def _config_check(path: str) -> int:
    cfg: Config = load_layered(path, os.environ)  # what `run` would use, flags aside
    env = sorted(k for k in os.environ if k.startswith(ENV_PREFIX) and k != "CIUIC_CONFIG")
    print(f"{path}: ok (preset {cfg.preset})" + (f" with {', '.join(env)}" if env else ""))
    for section in SECTIONS:
        values = getattr(cfg, section)
        for name in values.__dataclass_fields__:
            print(f"  {section}.{name} = {getattr(values, name)!r}")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    key = NodeKey.generate()
    key.save(args.out, overwrite=args.force)
    print(key.peer_id)
    print(f"public key: {key.public_key.hex()}  (give this to `ciuic-node ca issue --key`)")
    return 0


def _ca(args: argparse.Namespace) -> int:
    now = dt.datetime.now(dt.UTC)
    directory = Path(args.dir)
    if args.ca_command == "init":
        if (directory / "ca.key").exists():
            raise AdmissionError(f"{directory}: a CA already exists there")
        ca = ClusterCA.create(args.cluster, now)
        ca.save(directory)
        key_file, cert_file = directory / "ca.key", directory / "ca.pem"
        print(f"cluster {args.cluster!r}: CA written to {key_file} and {cert_file}")
        return 0
    ca = ClusterCA.load(directory)
    if args.ca_command == "issue":
        if Path(args.key).exists():
            public = NodeKey.load(args.key).public_key
        else:
            try:
                public = bytes.fromhex(args.key)
            except ValueError:
                raise IdentityError(
                    f"{args.key}: neither a key file nor a hex public key"
                ) from None
            if len(public) != 32:
                raise IdentityError("a public key is 32 bytes (64 hex digits)")
        if not 1 <= args.days <= 3650:
            raise AdmissionError("--days must be between 1 and 3650")
        if not any(public):
            raise IdentityError("an all-zero public key is not a key")
        cert = ca.issue(public, now, dt.timedelta(days=args.days))
        write_pem(args.out, cert)
        print(f"{peer_id_of(public)}: certificate written to {args.out}")
        return 0
    new = []
    for path in args.certs:
        cert = load_certificate(path)
        if cert.issuer != ca.certificate.subject or not _issued_by(cert, ca):
            raise AdmissionError(f"{path}: not issued by this CA")
        new.append(cert.serial_number)
    out = Path(args.out)
    old: list[int] = []
    if out.exists():
        crl = load_crl(out)
        Trust(ca.certificate, crl)  # refuses a list signed by another CA
        old = [r.serial_number for r in crl]
    added = len(set(new) - set(old))
    write_pem(out, ca.revocation_list(old + new, now))
    print(
        f"{added} node(s) newly revoked, {len(set(old + new))} in all; distribute {out} "
        "to every node (the list is valid 30 days: re-issue it before then)"
    )
    return 0


def _issued_by(cert: x509.Certificate, ca: ClusterCA) -> bool:
    try:
        ca.key.private_key.public_key().verify(cert.signature, cert.tbs_certificate_bytes)
    except InvalidSignature:
        return False
    return True


def _scenario_file(args: argparse.Namespace) -> Path:
    from ciuic_p2p.data import scenario_path, shipped_scenarios  # noqa: PLC0415

    path = scenario_path(args.scenario)
    if not path.exists():
        raise CiuicError(
            f"{args.scenario}: no such scenario file; shipped: {', '.join(shipped_scenarios())}"
        )
    if args.nodes and args.nodes < 2:
        raise CiuicError("--nodes must be at least 2")
    if args.pings < 1:
        raise CiuicError("--pings must be at least 1")
    return path


def _emulate(args: argparse.Namespace) -> int:
    from ciuic_p2p.emulator.processes import ProcessMesh  # noqa: PLC0415
    from ciuic_p2p.emulator.scenarios import load_scenario  # noqa: PLC0415

    path = _scenario_file(args)
    scenario = load_scenario(path)
    with ProcessMesh(path, nodes=args.nodes or None) as mesh:
        rtts = mesh.measure_rtts(pings=args.pings)
    rows = [
        {
            "src": a,
            "dst": b,
            "configured_ms": scenario.rtt_s(a, b) * 1e3,
            "measured_ms": None if rtt is None else rtt * 1e3,
        }
        for a, row in rtts.items()
        for b, rtt in row.items()
    ]
    if args.json:
        print(json.dumps({"scenario": str(path), "nodes": mesh.names, "pairs": rows}))
        return 0
    print(f"{len(mesh.names)} node processes on {path}:")
    for r in rows:
        measured = "lost" if r["measured_ms"] is None else f"{r['measured_ms']:8.1f} ms"
        print(f"  {r['src']:>24} -> {r['dst']:<24} {r['configured_ms']:8.1f} ms  {measured}")
    return 0


def _netem(args: argparse.Namespace) -> int:
    from ciuic_p2p.emulator import netns  # noqa: PLC0415
    from ciuic_p2p.emulator.processes import ProcessMesh  # noqa: PLC0415
    from ciuic_p2p.emulator.scenarios import load_scenario  # noqa: PLC0415

    path = _scenario_file(args)
    scenario = load_scenario(path)
    if args.nodes:
        scenario = scenario.subset(scenario.node_names()[: args.nodes])
    if args.dry_run:
        up, down = netns.commands(scenario, "DRY")
        for cmd in up + down:
            print(" ".join(cmd))
        return 0
    try:
        with (
            netns.namespaces(scenario) as spaces,
            ProcessMesh(path, nodes=len(scenario.nodes), namespaces=spaces) as mesh,
        ):
            rtts = mesh.measure_rtts(pings=args.pings)
    except netns.NetemUnavailable as exc:
        print(f"ciuic-node: netem unavailable: {exc}", file=sys.stderr)
        return netns.EXIT_NO_NETEM
    for a, row in rtts.items():
        for b, rtt in row.items():
            shown = "lost" if rtt is None else f"{rtt * 1e3:8.1f} ms"
            print(f"  {a:>24} -> {b:<24} {scenario.rtt_s(a, b) * 1e3:8.1f} ms  {shown}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        done = _dispatch(args)
    except TransientError as exc:
        print(f"ciuic-node: error: {exc}", file=sys.stderr)
        return 1
    except CiuicError as exc:
        print(f"ciuic-node: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name not in TRAINING_MODULES:
            raise
        print(
            f"ciuic-node: error: {args.command} trains models and needs {exc.name}, which "
            "this environment lacks: pip install 'ciuic-p2p[demo]'",
            file=sys.stderr,
        )
        return 2
    except BrokenPipeError:  # `ciuic-node ... | head`: the reader has what it wanted
        # What is still buffered goes nowhere at exit, not into a second traceback
        # (the recipe of Python's signal documentation).
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a path the user gave: missing, unwritable, a directory...
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"ciuic-node: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    if done is None:
        parser.print_help()
        return 0
    return done


def _dispatch(args: argparse.Namespace) -> int | None:
    """Run the command; None when none was given."""
    if args.command == "config" and args.config_command == "check":
        return _config_check(args.file)
    if args.command == "config" and args.config_command == "example":
        from ciuic_p2p.config.example import example_toml  # noqa: PLC0415

        sys.stdout.write(example_toml())
        return 0
    simple = {"keygen": _keygen, "ca": _ca, "emulate": _emulate, "netem": _netem}
    if args.command in simple:
        return simple[args.command](args)
    if args.command == "audit":
        from ciuic_p2p.cli.audit import audit_main  # noqa: PLC0415

        return audit_main(args)
    if args.command == "run":
        from ciuic_p2p.daemon.run import run  # noqa: PLC0415

        return run(args)
    if args.command in CONTROL_COMMANDS:
        from ciuic_p2p.cli.control import steer  # noqa: PLC0415

        return steer(args)
    if args.command == "completion":
        from ciuic_p2p.cli.completion import completion_main  # noqa: PLC0415

        return completion_main(build_parser(), args.shell)
    if args.command == "demo":
        from ciuic_p2p.lab.demo import run_demo  # noqa: PLC0415

        return run_demo(args)
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
