"""ciuic-p2p: train one model on GPU nodes spread over continents.

Nodes exchange top-k sparsified, INT8-quantized updates with error feedback over
mutually authenticated QUIC. See docs/architecture.md for the map of the code.

    sync = ciuic_p2p.attach(model, optimizer, run="my-run")
    ...; optimizer.step(); sync.step()
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "attach"]


def __getattr__(name: str) -> Any:
    # The CLI and the daemon import this package; only trainers pay for torch.
    if name == "attach":
        try:
            from ciuic_p2p.train.attach import attach  # noqa: PLC0415
        except ModuleNotFoundError as exc:
            if exc.name not in ("torch", "numpy"):
                raise
            raise ModuleNotFoundError(
                f"ciuic_p2p.attach needs {exc.name}: pip install 'ciuic-p2p[train]'",
                name=exc.name,
            ) from exc
        return attach
    raise AttributeError(name)
