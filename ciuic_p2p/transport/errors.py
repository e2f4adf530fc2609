"""Errors of the transport layer."""

from __future__ import annotations

from ciuic_p2p.errors import CiuicError


class TransportError(CiuicError):
    """A link could not be set up or was lost; the message says why."""


class DuplicateLinkError(TransportError):
    """Both ends dialled at once and the peer kept the other connection."""


class RefusedError(TransportError):
    """The peer (or our own check of it) refused the link: a credential problem that
    retrying will not fix."""
