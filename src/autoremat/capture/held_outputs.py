"""Node outputs held by the object the model returns, though the loss does not read them.

A Hugging Face causal LM returns a ``ModelOutput`` holding, beside the logits, the key/value cache
it made for the step (``use_cache=True`` is the default), and, when asked, every layer's hidden
states (``output_hidden_states=True``) and attention weights (``output_attentions=True``); a model
given ``labels`` returns the logits beside the loss it computed (:mod:`._loss_reach`). The loss
reads none of these, so no gradient is seeded into them, yet they live as long as the returned
object: GPT-NeoX's rotary embeddings run in fp32, its cache keeps the fp32 keys and values while
attention saves bf16 casts of them (under bf16 autocast the step's peak was predicted at 0.837x of
measured before this was modelled). Capture marks such nodes ``held_by_output``
(:class:`~autoremat.graph.Graph`); every cost model holds their storage until the loss
(:meth:`~autoremat.graph.Graph.held_to_loss`), with no gradient seed.

**What "held" means here: until the loss has been computed.** The step this project measures and
plans drops the output object once the loss is computed, before backward:
:func:`autoremat.measure.run_step` (``loss_fn(model(...)).backward()``), ``benchmarks/hf_breadth.py``,
capture's own recorded step (below), the integrations' trial steps, and Lightning's ``training_step``
returning ``out.loss`` (its locals are gone when Lightning runs backward). A loop that keeps the
object through backward (``outputs = model(**batch); accelerator.backward(outputs.loss)``, the usual
Accelerate loop; a ``training_step`` returning a dict, whose other entries Lightning keeps for the
closure) holds these bytes to the end of backward as well; that is not modelled (the prediction is
then low by up to those bytes while backward runs): drop the object first (``loss =
model(**batch).loss``), or pass ``use_cache=False`` when the cache is not used.

**How they are found: by measurement.** Capture's recorded step drops the output object right after
the loss, as the step does; the node outputs whose storage is freed at that moment were held by it
and by nothing else (anything still holding them, a node's saved tensors or the loss's, keeps them
longer anyway). This needs no knowledge of the object's layout (a ``DynamicCache``'s layers, a
tuple of hidden states). Not covered: storages made inside a module-level node (``blocks="module"``)
that the object holds, which are no node's output; blocks captured op by op (the default) record
each op's output as a node. An fx capture marks every tensor the model returns an output already.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OutputHold"]


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
