"""Solving in a forked child with a time limit (a solver that runs too long is killed)."""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings
from typing import Any

import autoremat


def solve_limited(graph: autoremat.Graph, budget_bytes: int, solver: str, timeout_s: float | None
                  ) -> tuple[str, Any, float]:
    """``("ok", plan, s)``, ``("infeasible", min_budget_bytes, s)``, ``("timeout", None, s)`` or
    ``("error", text, s)``. With a timeout the solver runs in a forked child that is killed when
    time runs out (solvers are pure Python over the graph)."""
    def run() -> tuple[str, Any, float]:
        t0 = time.perf_counter()
        try:
            plan = autoremat.solve(graph, int(budget_bytes), solver=solver)
            return "ok", plan.to_dict(), time.perf_counter() - t0
        except autoremat.InfeasibleBudgetError as err:
            return "infeasible", err.min_budget_bytes, time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001 - recorded in the results
            return "error", f"{type(err).__name__}: {err}", time.perf_counter() - t0

    if not timeout_s or "fork" not in multiprocessing.get_all_start_methods():
        status, payload, s = run()
    else:
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)

        def child() -> None:
            try:
                send.send(run())
            finally:
                os._exit(0)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child runs no torch
            proc = ctx.Process(target=child, daemon=True)
            proc.start()
        send.close()
        if recv.poll(timeout_s):
            try:
                status, payload, s = recv.recv()
            except EOFError:
                status, payload, s = "error", "solver process died without an answer", float("nan")
        else:
            status, payload, s = "timeout", None, float(timeout_s)
        proc.kill()
        proc.join()
        recv.close()
    if status == "ok":
        payload = autoremat.Plan.from_dict(payload)
    return status, payload, s
