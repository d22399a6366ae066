"""``autoremat.cost``: the package's names are the simulator's, and importing it loads no model
beyond the simulator (the solvers load theirs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import autoremat
from autoremat import cost
from autoremat.cost import simulator


def test_public_names_are_the_simulators():
    assert autoremat.simulate is cost.simulate is simulator.simulate
    assert autoremat.Simulation is cost.Simulation
    assert cost.DEFAULT_BANDWIDTH_BYTES_PER_S == 12e9
    assert set(cost.__all__) <= set(dir(cost))


def test_importing_the_package_loads_only_the_simulator():
    """With ``autoremat/__init__`` bypassed (it imports the solvers, and they their models)."""
    pkg = str(Path(autoremat.__file__).resolve().parent)
    code = ("import sys, types; pkg = types.ModuleType('autoremat'); pkg.__path__ = [" + repr(pkg) + "]; "
            "sys.modules['autoremat'] = pkg; import autoremat.cost; "
            "print(sorted(m for m in sys.modules if m.startswith('autoremat.cost.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout)  # a printed list of module names
    assert "autoremat.cost.simulator" in loaded and "autoremat.cost.segment_replay" not in loaded
