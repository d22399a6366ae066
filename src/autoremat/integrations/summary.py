"""The summary table both integrations print (rank zero / the main process): what autoremat
did, from where the plan came, the reachable range, and what it did not do.

:func:`summarise` builds the plain dict (kept in ``AutoRemat.summary`` and in the plan cache),
:func:`summary_table` turns it into a ``rich`` table, :func:`print_summary` prints it.
"""

from __future__ import annotations

from typing import Any

from .._units import fmt_bytes
from ..budget import reachable_range_text
from ..graph import Graph
from ..plan import Plan
from ..cost import simulate, unoptimised_peak_bytes

__all__ = ["summarise", "summary_table", "print_summary", "held_by_output_bytes", "HELD_CAPTION_SHARE"]


def summarise(plan: Plan, graph: Graph | None, *, step_budget: int | None, resident: int | None,
              least: int | None = None, measured: int | None = None, source: str = "profiled",
              budget_note: str | None = None, batch_before: int | None = None, batch_after: int | None = None,
              not_raised: str | None = None) -> dict[str, Any]:
    """The summary of one decision (``graph`` ``None``: a plan reused without a capture)."""
    if graph is not None:
        sim = simulate(graph, plan, check=False, record=False,
                       bandwidth_bytes_per_s=plan.bandwidth_bytes_per_s)
        predicted, extra, step = sim.peak_bytes, sim.extra_time_s, sim.step_time_s - sim.extra_time_s
        vanilla: int | None = unoptimised_peak_bytes(graph)
        nodes, mode, times = len(graph), graph.meta.get("mode"), graph.meta.get("time_source")
        held: int | None = held_by_output_bytes(graph)
        kept: str | None = graph.output_kept
    else:
        predicted, extra, step = plan.predicted_peak_bytes, plan.predicted_extra_time_s, None
        vanilla, nodes, mode, times, held = None, len(plan.node_names or ()), \
            plan.graph_mode, None, None
        kept = None
    stability = plan.options.get("stability") or {}
    return {
        "source": source, "solver": plan.solver, "segments": len(plan.segments),
        "recomputed": len(plan.recompute_segments), "offloaded": len(plan.offload) + len(plan.offload_saved),
        "graph_nodes": nodes, "graph_mode": mode, "time_source": times,
        "step_budget_bytes": step_budget, "budget_note": budget_note, "resident_bytes": resident,
        "least_budget_bytes": least, "unoptimised_peak_bytes": vanilla, "predicted_peak_bytes": predicted,
        "measured_peak_bytes": measured,
        "predicted_overhead": None if extra is None or not step else extra / max(step, 1e-12),
        "stability": stability.get("chosen"),
        "stability_tolerance": max(stability.get("tolerance") or 0.0, stability.get("time_noise") or 0.0) or None,
        "batch_size_before": batch_before, "batch_size_after": batch_after,
        "batch_size_not_raised": not_raised, "held_by_output_bytes": held, "output_kept": kept,
    }


def held_by_output_bytes(graph: Graph) -> int:
    """Bytes the model's returned object holds that the loss does not read (a key/value cache,
    hidden states, the logits beside a loss computed with ``labels``:
    :mod:`autoremat.capture.held_outputs`), each storage once. Plans hold them until the loss or to
    the end of backward, as ``graph.meta["output_kept"]`` says."""
    roots = {graph.root(v) for v in graph.nodes if graph.node(v)["held_by_output"]}
    return sum(int(graph.node(r)["out_bytes"]) for r in roots)


def _bytes(value: int | None) -> str:
    return "n/a" if value is None else fmt_bytes(value)


def batch_size_row(summary: dict[str, Any]) -> str:
    """What the batch-size step did, or why it did not run."""
    before, after, why = summary["batch_size_before"], summary["batch_size_after"], summary["batch_size_not_raised"]
    if why is not None:
        return f"not raised: {why}" if before is None else f"{before} (not raised: {why})"
    if after == before:
        return f"{before} (already the largest that fits)"
    return f"{before} -> {after} (raised)"


HELD_CAPTION_SHARE = 0.01
"""The summary says what the model's output holds beside the loss (and what a loop keeping it
should pass) where those bytes are at least this share of the predicted step peak: below it,
holding them longer than planned moves the peak by less (a sequence classifier's logits beside
its loss: 24 bytes of a 4.5 MiB step)."""


def summary_table(summary: dict[str, Any], title: str = "AutoRemat") -> Any:
    """A ``rich`` table of :func:`summarise`'s dict."""
    from rich.table import Table

    s = summary
    table = Table(title=title)
    table.add_column("")
    table.add_column("value", justify="right")
    graph = f"{s['graph_mode']} graph, {s['graph_nodes']} nodes" if s["graph_mode"] else "no graph"
    budget = _bytes(s["step_budget_bytes"]) + (f" ({s['budget_note']})" if s.get("budget_note") else "")
    vanilla = "unoptimised step peak" + ("" if s["batch_size_after"] is None else f" (batch {s['batch_size_after']})")
    overhead = "n/a" if s["predicted_overhead"] is None else f"{s['predicted_overhead']:.1%}"
    rows = [
        ("plan from", s["source"]),
        ("solver", f"{s['solver']} ({graph})"),
        ("segments (recomputed)", f"{s['segments']} ({s['recomputed']})" +
         (f", {s['offloaded']} offloaded" if s.get("offloaded") else "")),
        ("resident before a step", _bytes(s["resident_bytes"])),
        ("step-peak budget", budget),
        ("reachable step peak", "n/a" if s["least_budget_bytes"] is None or s["unoptimised_peak_bytes"] is None
         else reachable_range_text(s["least_budget_bytes"], s["unoptimised_peak_bytes"], short=True)),
        (vanilla, _bytes(s["unoptimised_peak_bytes"])),
        ("predicted step peak", _bytes(s["predicted_peak_bytes"])),
        ("measured step peak", _bytes(s["measured_peak_bytes"])),
        ("predicted time overhead", overhead),
        ("batch size", batch_size_row(s)),
    ]
    for key, value in rows:
        table.add_row(key, str(value))
    captions = []
    if s.get("stability") == "reference":
        tolerance = s.get("stability_tolerance") or 0.0
        captions.append(f"a rerun keeps this plan: within timing noise ({tolerance:.0%} of the step) of the fastest")
    held, peak = s.get("held_by_output_bytes") or 0, s.get("predicted_peak_bytes")
    if held and (peak is None or held >= HELD_CAPTION_SHARE * peak):
        captions.append(_held_caption(fmt_bytes(held), s.get("output_kept") or "loss"))
    if captions:
        table.caption = "\n".join(captions)
    return table


def _held_caption(held: str, kept: str) -> str:
    """What the plan assumed of the bytes the output holds, and what a loop stepped otherwise does."""
    what = f"the model's output holds {held} the loss does not read (logits beside the loss, a key/value cache)"
    if kept == "step":
        return (f"{what}; planned as kept to the end of backward (output_kept='step', as outputs = model(...); "
                "backward(outputs.loss) does): a loop that drops it first (loss = model(...).loss) can pass "
                "output_kept='loss' for a lower plan")
    return (f"{what}; planned as dropped once the loss is computed (output_kept='loss'): a loop that keeps the "
            "output through backward holds it longer than planned: pass output_kept='step', drop it first "
            "(loss = model(...).loss) or pass use_cache=False")


def print_summary(summary: dict[str, Any], title: str = "AutoRemat") -> None:
    """Print :func:`summary_table` (the caller decides the rank)."""
    from rich.console import Console

    Console().print(summary_table(summary, title))
