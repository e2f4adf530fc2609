"""Pure cores: protocol and codec logic without I/O, clocks or sockets.

Nothing under ``ciuic_p2p.core`` imports asyncio, socket, time or a transport; the
I/O edges drive these modules and move their bytes (see docs/architecture.md).
"""
