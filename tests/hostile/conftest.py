"""Fixtures the hostile tests share: the transport tests' cluster CA and nodes, and
the daemon tests' fleet of `ciuic-node run` processes."""

from tests.daemon.conftest import fleet
from tests.transport.conftest import cluster, make_node, quic_backend

__all__ = ["cluster", "fleet", "make_node", "quic_backend"]
