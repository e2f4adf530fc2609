"""``python -m ciuic_p2p``: the same as ``ciuic-node``."""

import sys

from ciuic_p2p.cli import main

sys.exit(main())
