""":func:`~autoremat.cost.simulate` for many plans on one graph, with what does not depend on the plan built once.

A solver that judges hundreds of offload sets on one base plan (``offload-dag``, Beaumont's chain
solvers, ``combined``) paid, per simulation of a 4,307-node graph, for lists that depend only on the
graph (each node's attributes, each output's storage key) or only on the plan's segments (execution
positions, :func:`~autoremat.plan.wait_points`): a few milliseconds of every simulation. A
:class:`RepeatedSimulator` builds them once (per graph; per segments, which are frozen) and runs
the simulator's own step with them: no rule of its own, the same code path;
``tests/cost/test_repeated.py`` checks it equal to ``simulate`` on seeded random graphs and plans.
The graph must not be edited while one is in use.

:func:`forward_floor_bytes`: a step peak no plan goes below (each node's forward allocates its
output, unless it is a view, and holds its saved extras and workspace while it runs; every plan
runs every node's forward), so a solver can tell at once that a budget under it is not met
(property test on the same random graphs and plans, offloads included).
"""

from __future__ import annotations

from ..graph import Graph
from ..plan import Plan, Segment, wait_points
from .ledger import StepState
from . import simulator
from .simulator import Simulation, _okey

__all__ = ["RepeatedSimulator", "forward_floor_bytes"]


def forward_floor_bytes(graph: Graph) -> int:
    """The least simulated step peak any plan of ``graph`` can have, at most (module docstring): the
    largest level a single node's forward reaches on its own, its new output plus its saved extras and
    workspace (``simulate``'s touch after it allocates the output)."""
    return max((int(d["alloc_bytes"]) * (d["alias_of"] is None) + int(d["extra_saved_bytes"]) + int(d["fwd_temp_bytes"])
                for d in (graph.node(v) for v in graph.nodes)), default=0)


class RepeatedSimulator:
    """``simulate(graph, plan, check=False, record=False, ...)`` with the graph's lists built once."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._nd = [graph.node(v) for v in graph.nodes]
        self._ok = [_okey(graph, v) for v in graph.nodes]
        self._by_segments: dict[tuple[Segment, ...], tuple[dict[int, int], set[int] | None]] = {}

    def _of_segments(self, plan: Plan, waits: bool) -> tuple[dict[int, int], set[int] | None]:
        key = tuple(plan.segments)  # frozen segments: equal segments give equal positions and wait points
        got = self._by_segments.get(key)
        if got is None or (waits and got[1] is None):
            pos = {v: i for i, v in enumerate(v for seg in key for v in seg.nodes)}
            got = (pos, wait_points(self.graph, plan) if waits else None)
            self._by_segments[key] = got
        return got

    def __call__(self, plan: Plan, *, bandwidth_bytes_per_s: float | None = None,
                 offload_wait_limit_bytes: int | None = None) -> Simulation:
        pos, points = self._of_segments(plan, offload_wait_limit_bytes is not None)
        pre = {"nd": self._nd, "ok": self._ok, "pos": pos, "points": points}
        return simulator._run(self.graph, plan, StepState(self.graph, False), bandwidth_bytes_per_s,
                              offload_wait_limit_bytes, pre=pre)
