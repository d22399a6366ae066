"""Node outputs held by the object the model returns, though the loss does not read them.

A Hugging Face causal LM returns a ``ModelOutput`` holding, beside the logits, the key/value cache
it made for the step (``use_cache=True`` is the default), and, when asked, every layer's hidden
states (``output_hidden_states=True``) and attention weights (``output_attentions=True``); a model
given ``labels`` returns the logits beside the loss it computed (:mod:`._loss_reach`). The loss
reads none of these, so no gradient is seeded into them, yet they live as long as the returned
object: GPT-NeoX's rotary embeddings run in fp32, its cache keeps the fp32 keys and values while
attention saves bf16 casts of them (under bf16 autocast the step's peak was predicted at 0.837x of
measured before this was modelled). Capture marks such nodes ``held_by_output``
(:class:`~autoremat.graph.Graph`); every cost model holds their storage as long as the step keeps
the object (:meth:`~autoremat.graph.Graph.held_until`), with no gradient seed.

**How long "held" is: ``graph.meta["output_kept"]``, the one graph-level choice.**

``"loss"`` (the default)
    The step drops the object once the loss is computed, before backward: the storages of
    ``held_by_output`` and ``is_output`` nodes are held until the loss
    (:meth:`~autoremat.graph.Graph.held_to_loss`). So do :func:`autoremat.measure.run_step`
    (``loss = loss_fn(model(...)); loss.backward()``), ``benchmarks/hf_breadth.py``, capture's own
    recorded step (below), and Lightning's ``training_step`` returning ``out.loss`` (its locals are
    gone when Lightning runs backward): :class:`~autoremat.integrations.lightning.AutoRemat`'s
    default.
``"step"``
    The loop keeps the object to the end of backward, ``outputs = model(**batch);
    accelerator.backward(outputs.loss)``, the usual Accelerate loop (a ``training_step`` returning
    the object, or a dict whose other entries Lightning keeps for the closure, does the same): those
    storages live until the last backward node has run (:meth:`~autoremat.graph.Graph.held_to_end`);
    a model output the loss reads (``is_output``) keeps its gradient seed as before, and its storage
    lives as long too. :func:`autoremat.integrations.accelerate.prepare`'s default; measured with
    ``run_step(..., keep_output=True)``. With ``labels`` the logits (batch x sequence x vocabulary)
    are then alive at the LM head's backward, where the step usually peaks: GPT-2 given labels
    (``autoremat.zoo.hf_breadth`` ``gpt2_labels``), stepped that way, measured 1.00001x of the
    ``"step"`` prediction and 1.050x of the ``"loss"`` one (x86_64, 2 cores, CPU;
    ``tests/integrations/test_output_kept.py``).

Any other value is refused (:func:`~autoremat.graph.check_output_kept`). It is no part of the
graph's fingerprint: a plan made under one applies to the model under the other, only its
predicted peak differs. The integrations set it before solving (``output_kept=``) and their
summary table says which the plan assumed.

**How they are found: by measurement.** Capture's recorded step drops the output object right after
the loss, as the step does; the node outputs whose storage is freed at that moment were held by it
and by nothing else (anything still holding them, a node's saved tensors or the loss's, keeps them
longer anyway). This needs no knowledge of the object's layout (a ``DynamicCache``'s layers, a
tuple of hidden states). Not covered: storages made inside a module-level node (``blocks="module"``)
that the object holds, which are no node's output; blocks captured op by op (the default) record
each op's output as a node. An fx capture does the same (:func:`autoremat.capture.fx.profile_fx`): it
seeded a gradient into every tensor the model returned until 2026-11-27 (a model returning its loss
beside the logits was predicted at 1.36x of its measured peak).
"""

from __future__ import annotations

from typing import Any

from ._recorder import tensors_in

__all__ = ["OutputHold", "mark_outputs"]


class OutputHold:
    """Which node outputs die when the step drops its output object (see the module docstring).

    Make it just before the drop (``owner``: storage key -> the node whose output lives in it, for
    the storages alive now, kept up to date as they die), then call :meth:`mark` just after.
    """

    def __init__(self, owner: dict[int, int]) -> None:
        self._owner = owner
        self._alive = dict(owner)

    def mark(self, nodes: list[Any]) -> list[int]:
        """Set ``held_by_output`` on the records in ``nodes`` whose output storage died since this
        object was made and that are not model outputs the loss reads; returns those nodes."""
        held = sorted({v for key, v in self._alive.items() if key not in self._owner and not nodes[v].is_output})
        for v in held:
            nodes[v].held_by_output = True
        return held


def mark_outputs(rec: Any, out: Any) -> dict[Any, set[int]]:
    """Mark the nodes of recorder ``rec`` whose storage holds a tensor of the model's output ``out`` as outputs;
    returns their autograd nodes -> those nodes. A function of its own, so that no local of the
    caller (a loop variable) holds an output tensor once ``out`` is dropped."""
    producers: dict[Any, set[int]] = {}
    for t in tensors_in(out):
        k = t.untyped_storage()._cdata
        if k in rec.owner:
            rec.nodes[rec.owner[k]].is_output = True
            if t.grad_fn is not None:
                producers.setdefault(t.grad_fn, set()).add(rec.owner[k])
    return producers
