"""The emulator's tests reuse the transport's cluster fixture (CA and credentials)."""

from tests.transport.conftest import cluster

__all__ = ["cluster"]
