"""``python benchmarks/compare [options]`` (a folder with ``__main__.py`` runs as a script) and
``python -m compare`` from ``benchmarks/``."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: its parent (benchmarks/) holds the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from compare.cli import main
else:
    from .cli import main

main()
