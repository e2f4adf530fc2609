"""Addresses as users write them: ``HOST:PORT`` or ``[V6]:PORT``."""

from __future__ import annotations

import ipaddress


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str, *, any_port: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; ValueError with the reason otherwise. Port 0
    (let the system choose) only with ``any_port``: one listens there, never dials."""
    host, sep, port = text.rpartition(":")
    lowest = 0 if any_port else 1
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT")
    if not lowest <= int(port) < 65536:
        raise ValueError(f"{text!r}: port {port} is out of range ({lowest}-65535)")
    return host.strip("[]"), int(port)


def network_of(host: str) -> str:
    """The /24 (IPv4) or /56 (IPv6) that ``host`` belongs to: the unit in which
    strangers are counted and capped (one network can hold many addresses and any
    number of ports); ``host`` itself when it is not an IP address."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return host[:64]
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = 24 if ip.version == 4 else 56
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))
