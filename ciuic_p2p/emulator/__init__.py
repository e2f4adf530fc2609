"""The WAN emulator's I/O edge: link models (core.netem) applied to real datagrams."""
