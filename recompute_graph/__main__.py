"""``python -m recompute_graph`` runs the command line (see recompute_graph.cli)."""
import sys

from .cli import main

sys.exit(main())
