"""What a module-level replay holds beyond the cost model's last reader: the values its calls return.

At module level a recomputed segment's replay runs the user's code again (the calls it recomputes).
What a replayed call computes for later nodes (read after the segment, or held by the returned
object) is in its Python frames (locals, the values the call returns) until the replay ends or stops
early; the simulator would free it after its last reader inside the segment. Measured (CPU, Hugging
Face T5 and LongT5, least plans): the relative position bias a replayed layer computes and returns to
the next layers was predicted freed after the attention's score add; the step peak in the replay's
softmax was predicted 0.984x (T5) and 0.981x (LongT5) of the measured one, exact with this rule. An fx
replay frees each value after its last use (fx's generated code; the region's outputs have no reader
in the replay graph), so nothing is held at fx level. The exact model of ``dp-exact`` and ``milp``
(:mod:`.segment_replay`) recomputes one node per segment at module level
(:meth:`~autoremat.cost.bitsets.GraphBits.recompute_flag`): nothing runs after it in its replay, so the
rule never applies there.
"""

from __future__ import annotations

from ..graph import Graph
from ..plan import Segment

__all__ = ["returned_by_replay"]


def returned_by_replay(g: Graph, nd: list[dict], seg: Segment, todo: list[int]) -> set[int]:
    """The nodes of a module-level replay of ``seg`` (``todo``: those it runs; ``nd``: the nodes'
    attributes) whose output its frames hold to the replay's end (module docstring)."""
    if g.meta.get("mode") != "module":
        return set()
    inside = set(seg.nodes)
    kept = set(seg.keep)
    return {v for v in todo if v not in kept and nd[v]["alias_of"] is None
            and (g.held_to_loss(v) or any(w not in inside for w in g.succ(v)))}
