"""``autoremat.offload``: the offloading namespace (chain model, chain solvers, bandwidth).

It gathers names that live in :mod:`autoremat.cost` and :mod:`autoremat.solvers.beaumont`; here:
they are the same objects, and the namespace imports and plans with torch unimportable.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import autoremat.offload as offload
from autoremat.cost import chain, chain_replay, chain_schedule
from autoremat.solvers.beaumont import chain_solvers

PKG = Path(__file__).resolve().parents[2] / "src" / "autoremat"


def test_the_namespace_holds_the_same_objects():
    assert offload.Chain is chain.Chain and offload.chain_from_graph is chain.chain_from_graph
    assert offload.simulate_offload is chain_replay.simulate_offload
    assert offload.validate_schedule is chain_schedule.validate_schedule
    assert offload.offload_dp is chain_solvers.offload_dp and offload.lower_bound is chain_solvers.lower_bound
    assert set(offload.__all__) <= set(dir(offload))


# ---------------------------------------------------------------------- style
def test_offload_modules_import_no_torch():
    code = f"""
import sys, types, importlib.abc

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {{"torch", "lightning", "pytorch_lightning", "accelerate", "transformers"}}:
            raise ImportError("blocked: " + name)
        return None

sys.meta_path.insert(0, Block())
pkg = types.ModuleType("autoremat")
pkg.__path__ = [{str(PKG)!r}]
sys.modules["autoremat"] = pkg
from autoremat.offload import Chain, offload_dp, offload_greedy, vdnn, lower_bound, validate_schedule
c = Chain((1.0, 2.0, 1.0), (2.0, 4.0, 2.0), (0, 5, 3, 7), (0, 0, 0, 0), (0, 0, 0), (0, 0, 0),
          bandwidth_bytes_per_s=5.0)
for s in (offload_greedy(c, 11), offload_dp(c, 11), vdnn(c, 11)):
    validate_schedule(c, s)
    assert s.offloaded
assert not [m for m in sys.modules if m.split(".")[0] == "torch"]
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
