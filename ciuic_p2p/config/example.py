"""The annotated example config (``systemd/node.example.toml``, ``ciuic-node config
example``): every setting with its default and the documentation of its field, read
from ``config/sections.py`` itself so that the example cannot drift from the code.

Only the ``[node]`` lines a service install must set are active; every other line is
commented out, so that an installed copy follows the preset it names and the defaults
of later versions.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

from ciuic_p2p.config import Config
from ciuic_p2p.config import sections as config_sections

WIDTH = 86

SERVICE_VALUES: dict[str, tuple[str, str]] = {
    "name": ('"tokyo-1"', "EDIT: unique in the mesh"),
    "region": ('"aws:ap-northeast-1"', "EDIT"),
    "listen_host": ('"0.0.0.0"', "EDIT (default 127.0.0.1: loopback only)"),
    "advertise_host": ('"203.0.113.10"', "EDIT: the address others dial"),
    "join": ('["203.0.113.20:7946", "198.51.100.7:7946"]', "EDIT: any members"),
    "runtime_dir": ('"/run/ciuic"', "the unit's RuntimeDirectory"),
}
"""[node] keys set in the example, with the value shown and why."""


def _field_docs() -> dict[tuple[str, str | None], str]:
    tree = ast.parse(inspect.getsource(config_sections))
    docs: dict[tuple[str, str | None], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs[(node.name, None)] = ast.get_docstring(node) or ""
        for i, stmt in enumerate(node.body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                after = node.body[i + 1] if i + 1 < len(node.body) else None
                text = ""
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    text = str(after.value.value)
                docs[(node.name, stmt.target.id)] = text
    return docs


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        text = repr(value)
        return text if any(c in text for c in ".ein") else text + ".0"
    return repr(value)


def _comment(text: str) -> list[str]:
    flat = " ".join(text.split()).replace("``", "`")
    return [f"# {line}" for line in textwrap.wrap(flat, WIDTH)]


def example_toml() -> str:
    docs = _field_docs()
    cfg = Config.wan()
    out = [
        "# ciuic-node configuration: every setting, its default (the WAN preset) and what",
        "# it does. Lines starting `# key =` show a default: uncomment to change it. The",
        "# [node] lines that are set are the ones every service install edits.",
        "# Check with `ciuic-node config check FILE`; regenerate with `ciuic-node config",
        "# example`. Precedence: this file < CIUIC_<SECTION>_<KEY> variables < flags.",
        "",
        '# "wan" (nodes continents apart), "lan" (one data centre) or "local" (several',
        "# nodes on one machine); the keys set below override the preset.",
        'preset = "wan"',
    ]
    for section in dataclasses.fields(cfg):
        if section.name == "preset":
            continue
        values = getattr(cfg, section.name)
        cls = type(values).__name__
        out += ["", *_comment(docs[(cls, None)].split("\n\n")[0]), f"[{section.name}]"]
        for f in dataclasses.fields(values):
            out += _comment(docs.get((cls, f.name), ""))
            shown = SERVICE_VALUES.get(f.name) if section.name == "node" else None
            if shown is not None:
                out.append(f"{f.name} = {shown[0]}  # {shown[1]}")
            else:
                out.append(f"# {f.name} = {toml_value(getattr(values, f.name))}")
    return "\n".join(out) + "\n"
