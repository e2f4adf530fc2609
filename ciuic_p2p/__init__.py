"""ciuic-p2p: train one model on GPU nodes spread over continents.

Nodes exchange top-k sparsified, INT8-quantized updates with error feedback over
mutually authenticated QUIC. See docs/architecture.md for the map of the code.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
