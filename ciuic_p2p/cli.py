"""``ciuic-node``: the command-line entry point.

Subcommands arrive with the issues that implement them; each one answers ``--help``.
User mistakes end in one clear line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ciuic_p2p import __version__
from ciuic_p2p.config import Config, load_config
from ciuic_p2p.errors import CiuicError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ciuic-node",
        description=(
            "ciuic-p2p node daemon: trains one model across GPU nodes on slow, far links "
            "by exchanging sparse INT8 updates over authenticated QUIC."
        ),
    )
    parser.add_argument("--version", action="version", version=f"ciuic-node {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = config_sub.add_parser("check", help="validate a TOML config file and print it")
    check.add_argument("file", help="path of the TOML file")
    return parser


def _config_check(path: str) -> int:
    cfg: Config = load_config(path)
    print(f"{path}: ok (preset {cfg.preset})")
    for section in ("node", "codec", "transport", "log"):
        values = getattr(cfg, section)
        for name in values.__dataclass_fields__:
            print(f"  {section}.{name} = {getattr(values, name)!r}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "config" and args.config_command == "check":
            return _config_check(args.file)
    except CiuicError as exc:
        print(f"ciuic-node: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
