"""The same scenario with kernel netem: network namespaces, veth pairs and tc.

For hosts whose kernel has the netem queueing discipline. Each node gets a network
namespace with one veth into a bridge (in a switch namespace of its own, so the host's
namespace is never touched); addresses are 10.77.0.(i+1)/24, inside namespaces this
command creates. On each node's veth, an HTB root sends each destination's traffic to
its own class (rate) with a netem leaf (delay, jitter, loss, duplication), selected by
a u32 filter on the destination address. The nodes then run inside their namespaces
with user-space emulation off.

Where netem is missing (as on this project's build machines), it says so and exits
with status 3 before changing anything; tests skip with that reason. Everything
created is removed again on exit, also on errors and Ctrl+C.

Where kernel netem cannot say what the user-space model says, it differs (stated here
rather than hidden): netem reorders with jitter whatever ``reorder`` says; it has one
loss model per qdisc, so a Gilbert-Elliott link drops the separate random ``loss``;
and the scenario's schedule is not applied (the namespaces are static; use the
user-space emulator for schedules). netem's ``limit`` counts datagrams still waiting
out their delay, so it is sized to the link's bandwidth-delay product plus the queue.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from ciuic_p2p.emulator.model.netem import LinkParams
from ciuic_p2p.emulator.model.scenario import Scenario
from ciuic_p2p.errors import CiuicError

SUBNET = "10.77.0"
EXIT_NO_NETEM = 3


class NetemUnavailable(CiuicError):
    """This host cannot run the kernel netem set-up; the message says why."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
    if check and result.returncode != 0:
        raise CiuicError(f"{' '.join(cmd)}: {result.stderr.strip() or result.returncode}")
    return result


def probe() -> None:
    """Raise :class:`NetemUnavailable` unless namespaces and netem both work here."""
    if os.geteuid() != 0:
        raise NetemUnavailable("needs root (network namespaces and tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetemUnavailable(f"{tool} is not installed (Debian: iproute2)")
    ns = f"ciuic-probe-{os.getpid()}"
    if _run("ip", "netns", "add", ns, check=False).returncode != 0:
        raise NetemUnavailable("cannot create a network namespace")
    try:
        result = _run(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "netem",
            "delay",
            "1ms",
            check=False,
        )
        if result.returncode != 0:
            raise NetemUnavailable(
                f"this kernel has no netem queueing discipline (tc said: {result.stderr.strip()}); "
                "use the user-space emulator instead (ciuic-node emulate)"
            )
    finally:
        _run("ip", "netns", "del", ns, check=False)


def address(index: int) -> str:
    return f"{SUBNET}.{index + 1}"


def netem_args(p: LinkParams) -> list[str]:
    args = ["delay", f"{p.delay_s * 1000:.3f}ms"]
    if p.jitter_s > 0:
        args += [f"{p.jitter_s * 1000:.3f}ms"]
        if p.jitter_dist == "normal":
            args += ["distribution", "normal"]
    if p.ge_p > 0:
        args += [
            "loss",
            "gemodel",
            f"{p.ge_p * 100:.4f}%",
            f"{p.ge_r * 100:.4f}%",
            f"{p.ge_loss_bad * 100:.4f}%",
            f"{p.ge_loss_good * 100:.4f}%",
        ]
    elif p.loss > 0:
        args += ["loss", f"{p.loss * 100:.4f}%"]
    if p.duplicate > 0:
        args += ["duplicate", f"{p.duplicate * 100:.4f}%"]
    if p.rate_bps is not None:
        in_flight = p.rate_bps / 8 * (p.delay_s + 3 * p.jitter_s) / 1500
        args += ["limit", str(int(in_flight + p.queue_limit_bytes / 1500) + 8)]
    return args


def _ip(ns: str, spec: str) -> list[str]:
    return ["ip", "-n", ns, *spec.split()]


def _tc(ns: str, spec: str) -> list[str]:
    return ["ip", "netns", "exec", ns, "tc", *spec.split()]


def commands(scenario: Scenario, tag: str) -> tuple[list[list[str]], list[list[str]]]:
    """The set-up and tear-down commands for ``scenario`` (pure; printed by --dry-run)."""
    names = scenario.node_names()
    sw = f"ciuic-{tag}-sw"
    up = [
        ["ip", "netns", "add", sw],
        _ip(sw, "link add br0 type bridge"),
        _ip(sw, "link set br0 up"),
    ]
    down = [["ip", "netns", "del", sw]]
    for i, name in enumerate(names):
        ns = f"ciuic-{tag}-{i}"
        up += [
            ["ip", "netns", "add", ns],
            _ip(ns, f"link add eth0 type veth peer name p{i} netns {sw}"),
            _ip(sw, f"link set p{i} master br0 up"),
            _ip(ns, f"addr add {address(i)}/24 dev eth0"),
            _ip(ns, "link set eth0 up"),
            _ip(ns, "link set lo up"),
            _tc(ns, "qdisc add dev eth0 root handle 1: htb default 999"),
            _tc(ns, "class add dev eth0 parent 1: classid 1:999 htb rate 10gbit"),
        ]
        for j, peer in enumerate(names):
            if peer == name:
                continue
            p = scenario.params(name, peer)
            rate = f"{int(p.rate_bps)}bit" if p.rate_bps is not None else "10gbit"
            up += [
                _tc(ns, f"class add dev eth0 parent 1: classid 1:{j + 1} htb rate {rate}"),
                _tc(ns, f"qdisc add dev eth0 parent 1:{j + 1} handle {j + 10}: netem")
                + netem_args(p),
                _tc(
                    ns,
                    f"filter add dev eth0 protocol ip parent 1: prio 1 u32 match ip dst "
                    f"{address(j)}/32 flowid 1:{j + 1}",
                ),
            ]
        down.append(["ip", "netns", "del", ns])
    return up, down


@contextmanager
def namespaces(scenario: Scenario) -> Iterator[list[str]]:
    """Create the namespaces and shaping; yield the node namespaces; remove all."""
    probe()
    tag = str(os.getpid())
    up, down = commands(scenario, tag)
    try:
        for cmd in up:
            _run(*cmd)
        yield [f"ciuic-{tag}-{i}" for i in range(len(scenario.nodes))]
    finally:
        for cmd in down:
            _run(*cmd, check=False)
