"""Scenarios for the WAN emulator: nodes, per-link parameters, and a schedule.

A scenario comes from a TOML or JSON file, or from a CSV matrix alone:

- **CSV**: columns ``region_a``, ``region_b``, ``rtt_ms`` (others are ignored; if
  ``city_a``/``city_b`` exist they name the nodes). A pair that appears once is
  symmetric: each direction gets ``rtt_ms / 2``. A pair that appears once per
  direction is asymmetric: row (a, b) sets the one-way delay a → b to its ``rtt_ms / 2``.
  An optional bandwidth CSV (same pair columns) gives rates in Gbit/s from the column
  named by ``bandwidth_column`` (default ``dtfm_gbps_2022``, the per-pair rates used by
  Yuan et al. 2022); an empty cell, or a pair the file lacks, gets ``default_rate_gbps``
  (default 1.0).
- **TOML/JSON**: ``seed``, ``rate_scale``, ``[defaults]`` (LinkParams fields, times in
  ms), ``[matrix]`` (``rtt_csv``, ``bandwidth_csv``, ``bandwidth_column``,
  ``default_rate_gbps``; paths relative to the file), ``[[nodes]]`` (``name``,
  ``region``), ``[[links]]`` (``src``, ``dst``, fields; ``symmetric = true`` sets both
  directions) and ``[[schedule]]`` (below).

``uplink_gbps`` (top level: every node; or per ``[[nodes]]`` entry) shares one rate
among all of a node's outgoing links, as a NIC or an access link does.

``rate_scale`` multiplies every rate: measured inter-region links (0.3 to 5 Gbit/s)
are beyond what pure-Python QUIC pushes for several nodes on one small machine, so
benchmarks scale rates (and model and chunk sizes) down together and report the scale.

Schedule entries, each with ``at_s``: ``cut`` / ``heal`` (``between = [a, b]``, both
directions, or ``src``/``dst`` for one), ``isolate`` / ``rejoin`` (``node``),
``partition`` (``groups = [[...], [...]]``: links between groups go down),
``heal_all``, and ``set`` (``src``, ``dst``, optional ``symmetric``, and fields).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ciuic_p2p.emulator.model.netem import LinkModel, LinkParams
from ciuic_p2p.errors import ConfigError

DEFAULT_BANDWIDTH_COLUMN = "dtfm_gbps_2022"
DEFAULT_RATE_GBPS = 1.0
_MS_FIELDS = {"delay_ms": "delay_s", "jitter_ms": "jitter_s"}
ACTIONS = ("cut", "heal", "isolate", "rejoin", "partition", "heal_all", "set")


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    region: str = ""
    uplink_bps: float | None = None
    """What the node sends in all, over all its links (its NIC or access link): a
    token bucket with a FIFO queue in front of its links, as ``LinkParams.rate_bps``
    for one link (rate scale applied). None: each link is limited only by itself."""


@dataclass(frozen=True, slots=True)
class ScheduledChange:
    at_s: float
    action: str
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    nodes: tuple[NodeSpec, ...]
    links: Mapping[tuple[str, str], LinkParams]
    schedule: tuple[ScheduledChange, ...] = ()
    seed: int = 0
    rate_scale: float = 1.0

    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def params(self, src: str, dst: str) -> LinkParams:
        return self.links.get((src, dst), LinkParams())

    def rtt_s(self, a: str, b: str) -> float:
        """Configured round-trip propagation delay between two nodes."""
        return self.params(a, b).delay_s + self.params(b, a).delay_s

    def subset(self, names: Iterable[str]) -> Scenario:
        keep = list(names)
        missing = set(keep) - set(self.node_names())
        if missing:
            raise ConfigError(f"unknown nodes {sorted(missing)}")
        nodes = tuple(n for n in self.nodes if n.name in keep)
        links = {k: v for k, v in self.links.items() if k[0] in keep and k[1] in keep}
        return dataclasses.replace(self, nodes=nodes, links=links)


# -- loading ---------------------------------------------------------------------------


def parse_scenario(text: str, kind: str, read: Callable[[str], str], **overrides: Any) -> Scenario:
    """A scenario from the text of a ``toml``, ``json`` or bare ``csv`` RTT matrix
    (``kind``); ``read(name)`` gives the text of a file the scenario names (its matrix
    CSVs, relative to it). ciuic_p2p.emulator.scenarios reads the files."""
    if kind == "csv":
        return scenario_from_matrix(text, **overrides)
    try:
        data = json.loads(text) if kind == "json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"not valid {kind.upper()}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("a scenario is a table of keys")
    return scenario_from_mapping({**data, **overrides}, read)


def _no_files(name: str) -> str:
    raise ConfigError(f"{name}: this scenario may name no file")


def _read_rows(text: str, needed: tuple[str, ...]) -> list[dict[str, str]]:
    reader = csv.DictReader(text.splitlines())
    cols = reader.fieldnames or []
    missing = [c for c in needed if c not in cols]
    if missing:
        raise ConfigError(f"CSV lacks columns {missing} (has {cols})")
    return list(reader)


def _node_names(rows: list[dict[str, str]]) -> dict[str, str]:
    """region → node name: the city when the CSV has one, without any parenthesised
    note ("Chicago(proxy:Ohio)" → "Chicago")."""
    names: dict[str, str] = {}
    for row in rows:
        for side in ("a", "b"):
            region = row[f"region_{side}"]
            city = (row.get(f"city_{side}") or "").split("(")[0].strip()
            names.setdefault(region, city or region)
    return names


def scenario_from_matrix(
    rtt_csv: str,
    bandwidth_csv: str | None = None,
    bandwidth_column: str = DEFAULT_BANDWIDTH_COLUMN,
    default_rate_gbps: float | None = DEFAULT_RATE_GBPS,
    defaults: LinkParams | None = None,
    seed: int = 0,
    rate_scale: float = 1.0,
) -> Scenario:
    """Nodes and links from an RTT matrix (and rates from a bandwidth matrix). With
    ``default_rate_gbps=None`` and no bandwidth CSV, links are not rate-limited."""
    rows = _read_rows(rtt_csv, ("region_a", "region_b", "rtt_ms"))
    names = _node_names(rows)
    base = defaults or LinkParams()
    delays: dict[tuple[str, str], float] = {}
    directed: set[tuple[str, str]] = set()
    for i, row in enumerate(rows, start=2):
        a, b = names[row["region_a"]], names[row["region_b"]]
        try:
            rtt = float(row["rtt_ms"]) / 1000.0
        except ValueError as exc:
            raise ConfigError(
                f"RTT CSV line {i}: rtt_ms {row['rtt_ms']!r} is not a number"
            ) from exc
        if rtt < 0 or a == b:
            raise ConfigError(f"RTT CSV line {i}: bad pair or negative RTT")
        delays[(a, b)] = rtt / 2
        directed.add((a, b))
        if (b, a) not in directed:
            delays[(b, a)] = rtt / 2
    rates: dict[tuple[str, str], float] = {}
    if bandwidth_csv is not None:
        for i, row in enumerate(_read_rows(bandwidth_csv, ("region_a", "region_b")), start=2):
            if bandwidth_column not in row:
                raise ConfigError(f"bandwidth CSV has no column {bandwidth_column!r}")
            cell = (row[bandwidth_column] or "").strip()
            if not cell:
                continue
            try:
                gbps = float(cell)
            except ValueError as exc:
                raise ConfigError(f"bandwidth CSV line {i}: {cell!r} is not a number") from exc
            na, nb = names.get(row["region_a"]), names.get(row["region_b"])
            if na and nb:
                rates[(na, nb)] = rates[(nb, na)] = gbps * 1e9
    links = {}
    for pair, delay in delays.items():
        rate = rates.get(pair)
        if rate is None and default_rate_gbps is not None:
            rate = default_rate_gbps * 1e9
        links[pair] = base.with_changes(
            delay_s=delay, rate_bps=None if rate is None else rate * rate_scale
        )
    nodes = tuple(NodeSpec(name, region) for region, name in names.items())
    return Scenario(nodes=nodes, links=links, seed=seed, rate_scale=rate_scale)


def _link_fields(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(LinkParams)}
    hints = typing.get_type_hints(LinkParams)
    out: dict[str, Any] = {}
    for key, raw_value in raw.items():
        name = _MS_FIELDS.get(key, key)
        if name == "rate_mbps":
            out["rate_bps"] = float(raw_value) * 1e6
            continue
        if name not in known:
            raise ConfigError(f"{where}: unknown link field {key!r}")
        value = raw_value
        if key in _MS_FIELDS:
            value = float(raw_value) / 1000.0
        elif hints[name] in (float, "float") and isinstance(raw_value, int):
            value = float(raw_value)
        out[name] = value
    return out


_TOP_KEYS = {
    "seed",
    "rate_scale",
    "defaults",
    "matrix",
    "nodes",
    "links",
    "schedule",
    "uplink_gbps",
}


def scenario_from_mapping(
    data: Mapping[str, Any], read: Callable[[str], str] = _no_files
) -> Scenario:
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"unknown scenario keys {unknown} (known: {sorted(_TOP_KEYS)})")
    try:
        return _scenario_from_mapping(data, read)
    except KeyError as exc:
        raise ConfigError(f"missing key {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def _scenario_from_mapping(data: Mapping[str, Any], read: Callable[[str], str]) -> Scenario:
    seed = int(data.get("seed", 0))
    rate_scale = float(data.get("rate_scale", 1.0))
    if rate_scale <= 0:
        raise ConfigError("rate_scale must be > 0")
    try:
        defaults = LinkParams(**_link_fields(data.get("defaults", {}), "defaults"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"defaults: {_plain(exc)}") from exc
    matrix = data.get("matrix")
    if matrix:
        rtt_text = read(matrix["rtt_csv"])
        bw = matrix.get("bandwidth_csv")
        scenario = scenario_from_matrix(
            rtt_text,
            read(bw) if bw else None,
            bandwidth_column=matrix.get("bandwidth_column", DEFAULT_BANDWIDTH_COLUMN),
            default_rate_gbps=matrix.get("default_rate_gbps", DEFAULT_RATE_GBPS),
            defaults=defaults,
            seed=seed,
            rate_scale=rate_scale,
        )
        nodes = list(scenario.nodes)
        links = dict(scenario.links)
    else:
        nodes, links = [], {}
    nodes = _with_nodes(nodes, data, rate_scale)
    names = {n.name for n in nodes}
    for entry in data.get("links", []):
        raw = dict(entry)
        src, dst = raw.pop("src"), raw.pop("dst")
        symmetric = bool(raw.pop("symmetric", False))
        for a, b in [(src, dst), (dst, src)] if symmetric else [(src, dst)]:
            if a not in names or b not in names:
                raise ConfigError(f"link {a} -> {b}: unknown node")
            try:
                links[(a, b)] = links.get((a, b), defaults).with_changes(
                    **_link_fields(raw, f"link {a} -> {b}")
                )
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"link {a} -> {b}: {_plain(exc)}") from exc
    if not matrix:  # every pair not listed gets the defaults
        for a in names:
            for b in names:
                if a != b:
                    links.setdefault((a, b), defaults)
    schedule = tuple(
        sorted((_change(raw, names) for raw in data.get("schedule", [])), key=lambda c: c.at_s)
    )
    return Scenario(tuple(nodes), links, schedule, seed, rate_scale)


def _with_nodes(
    nodes: list[NodeSpec], data: Mapping[str, Any], rate_scale: float
) -> list[NodeSpec]:
    """The ``[[nodes]]`` entries added to (or set on) ``nodes``, with their uplinks."""
    out = list(nodes)
    for raw in data.get("nodes", []):
        if not any(n.name == raw["name"] for n in out):
            out.append(NodeSpec(raw["name"], raw.get("region", "")))
        if "uplink_gbps" in raw:
            i = next(i for i, n in enumerate(out) if n.name == raw["name"])
            uplink = _uplink(raw["uplink_gbps"], rate_scale, raw["name"])
            out[i] = dataclasses.replace(out[i], uplink_bps=uplink)
    if "uplink_gbps" in data:  # every node without its own
        every = _uplink(data["uplink_gbps"], rate_scale, "uplink_gbps")
        out = [
            n if n.uplink_bps is not None else dataclasses.replace(n, uplink_bps=every) for n in out
        ]
    return out


def _uplink(raw: Any, rate_scale: float, where: str) -> float:
    gbps = float(raw)
    if not 0 < gbps <= 1e4:
        raise ConfigError(f"{where}: uplink_gbps must be in (0, 10000]")
    return gbps * 1e9 * rate_scale


def _plain(exc: Exception) -> str:
    """A field of the wrong type fails inside LinkParams' checks with a comparison
    error; say what was wrong instead."""
    if isinstance(exc, TypeError):
        return "a field has the wrong type (numbers for times, rates and probabilities)"
    return str(exc)


def _change(raw: Mapping[str, Any], names: set[str]) -> ScheduledChange:
    args = dict(raw)
    at_s = float(args.pop("at_s", 0.0))
    action = args.pop("action", None)
    if action not in ACTIONS:
        raise ConfigError(f"schedule at {at_s}s: action must be one of {list(ACTIONS)}")
    mentioned = list(args.get("between", [])) + [
        args[k] for k in ("src", "dst", "node") if k in args
    ]
    mentioned += [n for g in args.get("groups", []) for n in g]
    unknown = [n for n in mentioned if n not in names]
    if unknown:
        raise ConfigError(f"schedule at {at_s}s: unknown nodes {unknown}")
    if action == "set":
        extra = {k: v for k, v in args.items() if k not in ("src", "dst", "symmetric")}
        _link_fields(extra, f"schedule at {at_s}s")
    return ScheduledChange(at_s, action, args)


# -- the emulated network --------------------------------------------------------------


UPLINK_QUEUE_BYTES = 1000 * 1500
"""A node's uplink queues up to a host's default transmit queue: 1000 packets
(``txqueuelen``) of 1500 bytes; past it, tail drop."""


class EmulatedNetwork:
    """Every directed link of a scenario, its schedule, and manual changes. Pure: the
    caller passes ``now`` (seconds since the scenario started)."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.links: dict[tuple[str, str], LinkModel] = {}
        names = scenario.node_names()
        for i, a in enumerate(names):
            for j, b in enumerate(names):
                if a != b:
                    seed = (scenario.seed * 1_000_003 + i * 1009 + j) & 0xFFFFFFFF
                    self.links[(a, b)] = LinkModel(scenario.params(a, b), seed)
        self.uplinks: dict[str, LinkModel] = {
            n.name: LinkModel(LinkParams(rate_bps=n.uplink_bps, queue_bytes=UPLINK_QUEUE_BYTES), 0)
            for n in scenario.nodes
            if n.uplink_bps is not None
        }
        """The nodes' shared uplinks: a datagram waits for its slot there, then for
        its link's."""
        self._down: set[tuple[str, str]] = set()
        self._next_change = 0

    def transmit(self, src: str, dst: str, now: float, size: int) -> list[float]:
        """Arrival times (same clock as ``now``) of a datagram from ``src`` to ``dst``."""
        self.advance(now)
        uplink = self.uplinks.get(src)
        if uplink is not None:
            left = uplink.transmit(now, size)  # no delay, jitter or loss: one time or none
            if not left:
                return []
            now = left[0]
        return self.links[(src, dst)].transmit(now, size)

    def advance(self, now: float) -> None:
        """Apply scheduled changes that are due."""
        schedule = self.scenario.schedule
        while self._next_change < len(schedule) and schedule[self._next_change].at_s <= now:
            self.apply(schedule[self._next_change])
            self._next_change += 1

    def next_change_at(self) -> float | None:
        schedule = self.scenario.schedule
        return schedule[self._next_change].at_s if self._next_change < len(schedule) else None

    def apply(self, change: ScheduledChange) -> None:
        a = change.args
        if change.action in ("cut", "heal"):
            pairs = _pairs(a)
            (self._down.update if change.action == "cut" else self._down.difference_update)(pairs)
        elif change.action in ("isolate", "rejoin"):
            node = a["node"]
            touching = {p for p in self.links if node in p}
            (self._down.update if change.action == "isolate" else self._down.difference_update)(
                touching
            )
        elif change.action == "partition":
            group_of = {n: i for i, g in enumerate(a["groups"]) for n in g}
            self._down.update(
                p
                for p in self.links
                if p[0] in group_of and p[1] in group_of and group_of[p[0]] != group_of[p[1]]
            )
        elif change.action == "heal_all":
            self._down.clear()
        elif change.action == "set":
            fields = _link_fields(
                {k: v for k, v in a.items() if k not in ("src", "dst", "symmetric")}, "set"
            )
            targets = [(a["src"], a["dst"])]
            if a.get("symmetric"):
                targets.append((a["dst"], a["src"]))
            for target in targets:
                link = self.links[target]
                link.set_params(link.params.with_changes(**fields))
        for pair, model in self.links.items():
            up = pair not in self._down
            if model.params.up != up:
                model.set_params(model.params.with_changes(up=up))

    def cut(self, a: str, b: str) -> None:
        self.apply(ScheduledChange(0.0, "cut", {"between": [a, b]}))

    def heal(self, a: str, b: str) -> None:
        self.apply(ScheduledChange(0.0, "heal", {"between": [a, b]}))

    def partition(self, *groups: list[str]) -> None:
        self.apply(ScheduledChange(0.0, "partition", {"groups": [list(g) for g in groups]}))

    def heal_all(self) -> None:
        self.apply(ScheduledChange(0.0, "heal_all"))


def _pairs(args: Mapping[str, Any]) -> set[tuple[str, str]]:
    if "between" in args:
        a, b = args["between"]
        return {(a, b), (b, a)}
    return {(args["src"], args["dst"])}
