"""The WAN emulator's I/O edge: link models (emulator.model.netem) applied to real datagrams."""
