"""``ciuic-node audit``: check a node's tamper-evident audit log.

``audit verify DIR`` reads every audit file in DIR in order and checks each entry's
signature against the node's public key and its place in the hash chain
(core.audit). It prints one line, ``ok: ...`` or ``BROKEN at FILE:LINE: reason``,
and exits 0 when the chain is intact, 1 when it is broken, 2 for a user error (one
line on stderr). A cut-off tail cannot be seen in the files: compare the printed seq
and head with what the running daemon reports.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ciuic_p2p.core.audit import AuditError
from ciuic_p2p.daemon.auditlog import public_key_from, verify_directory


def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``audit`` actions to ``parser`` (the ``audit`` subcommand's parser)."""
    sub = parser.add_subparsers(
        dest="audit_command", metavar="ACTION", required=True, help="what to do"
    )
    verify = sub.add_parser(
        "verify",
        help="check that no audit entry was edited, deleted, inserted or reordered",
        description=(
            "Check every entry's signature and place in the hash chain; exit 0 when "
            "intact, 1 when broken, 2 for a user error. A cut-off tail cannot be seen in "
            "the files: compare the printed seq and head with the daemon's."
        ),
    )
    verify.add_argument("dir", metavar="DIR", help="the audit directory (STATE_DIR/audit)")
    verify.add_argument(
        "--key",
        metavar="FILE|HEX",
        help="the node's certificate, key file or public key in hex (default DIR/../node.pem)",
    )
    verify.add_argument("--json", action="store_true", help="print JSON")


def audit_main(args: argparse.Namespace) -> int:
    """Run an ``audit`` action; errors are ciuic_p2p.cli's to report (one line, 2)."""
    return _verify(args)


def _verify(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    if not directory.is_dir():
        raise AuditError(f"{directory}: not a directory")
    key_spec = args.key
    if key_spec is None:
        default = directory / ".." / "node.pem"
        if not default.is_file():
            raise AuditError(
                f"{default} does not exist: give the node's certificate, key file or hex "
                "public key with --key"
            )
        key_spec = str(default)
    report = verify_directory(directory, public_key_from(key_spec))
    if args.json:
        broken = report.broken
        print(
            json.dumps(
                {
                    "ok": report.ok,
                    "entries": report.entries,
                    "files": report.files,
                    "first_seq": report.first_seq,
                    "last_seq": report.last_seq,
                    "head": report.head,
                    "broken": None
                    if broken is None
                    else {"file": broken.file, "line": broken.line, "reason": broken.reason},
                    "summary": report.summary(),
                }
            )
        )
    else:
        print(report.summary())
    return 0 if report.ok else 1
