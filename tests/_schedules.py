"""Schedules of the joint-graph model shared by its tests (Kumar et al.'s setting): the paper's
Figure 1, a checker that replays a schedule independently of :func:`simulate_schedule`, and every
scheduler's schedule of a joint graph."""

from __future__ import annotations

import networkx as nx

from autoremat.cost.schedule import COMPUTE, FREE, JointGraph, Schedule, no_remat, simulate_schedule, ScheduleStats
from autoremat.solvers.evaluation.twremat import twremat_schedule
from autoremat.solvers.xla_greedy import xla_greedy_schedule

__all__ = ["figure1", "check_schedule", "all_schedules"]


def figure1() -> JointGraph:
    """Kumar et al. Figure 1: A->B, B->C, B->D, C->D, A->E, D->E; unit sizes; E is final."""
    A, B, C, D, E = range(5)
    return JointGraph.from_dag(nx.DiGraph([(A, B), (B, C), (B, D), (C, D), (A, E), (D, E)]))


def check_schedule(joint: JointGraph, schedule: Schedule) -> ScheduleStats:
    """Validity (by the simulator) plus an independent replay of the same rules."""
    stats = simulate_schedule(joint, schedule)
    resident: set[int] = set()
    computed: set[int] = set()
    for action, v in schedule.ops:
        if action == COMPUTE:
            assert all(u in resident for u in joint.pred[v]) and v not in resident
            resident.add(v)
            computed.add(v)
        else:
            assert action == FREE and v in resident
            resident.discard(v)
    assert computed == set(range(len(joint))) and joint.final in resident
    assert stats.n_computes == len(schedule.computes)
    return stats



def all_schedules(j: JointGraph) -> dict[str, Schedule]:
    return {
        "noremat": no_remat(j),
        "tw1": twremat_schedule(j),
        "tw1-annotated": twremat_schedule(j, annotated=True),
        "tw4": twremat_schedule(j, 4),
        "tw4-min-degree": twremat_schedule(j, 4, heuristic="min_degree", annotated=True),
        "greedy": xla_greedy_schedule(j),
        "greedy-half": xla_greedy_schedule(j, simulate_schedule(j, no_remat(j)).peak_bytes // 2),
    }
