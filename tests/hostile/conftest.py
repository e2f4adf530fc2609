"""Fixtures the hostile tests share: the transport tests' cluster CA and nodes (the
fleet of `ciuic-node run` processes is tests/conftest.py's)."""

from tests.transport.conftest import cluster, make_node, quic_backend

__all__ = ["cluster", "make_node", "quic_backend"]
