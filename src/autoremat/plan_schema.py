"""The strict schema of a plan document: the dict of :meth:`Plan.to_dict` and its JSON file.

A plan file is something a user may edit by hand, truncate, or copy from another machine, so
:meth:`Plan.from_dict` / :meth:`Plan.from_json` check every field before a :class:`Plan` is
built, and refuse with one error class, :class:`~autoremat.errors.PlanFormatError`, whose
message names the field (``segments[2].recompute``), what was found and what is expected.

Decisions (tested in ``tests/test_plan.py`` and ``tests/test_bad_inputs.py``):

* Required keys: ``format`` (``"autoremat.plan"``), ``version`` and ``segments``; each segment
  needs ``nodes`` and ``recompute``. Every other key is optional with the :class:`Plan` default.
* Versions: 2 (this one) and 1. Format 1 kept what :func:`autoremat.apply` reads
  (``graph_mode``, ``node_names``, ``replay_tails``, ``tensors``, ``inputs``) inside
  ``options``; format 2 has them as top-level fields. Either place is checked the same way; a
  document that gives one of them in both places is refused (which one is meant?).
* Unknown top-level keys and unknown segment keys are refused (a misspelt ``"recompue"`` would
  otherwise be silently dropped). Unknown keys inside ``options`` are kept: solvers record
  their own options there.
* A segment may name ``keep`` (node ids of a recomputed segment whose outputs are kept:
  selective saves); ``module_calls`` maps a segment index to ``{"path", "keep_ops",
  "keep_names"}`` (the module call a module-level segment runs as and the ops it keeps).
* Booleans are JSON booleans: ``"recompute": "false"`` or ``0`` is refused, never read as true.
* Node ids are non-negative integers (not bools, not ``1.0``); byte counts are non-negative
  integers; times are finite non-negative numbers.
* ``offload_saved`` is a list of node ids (nodes whose own saved tensors are offloaded). A unit id
  is a node id of ``offload`` or ``-1 - w`` for ``w`` of ``offload_saved``
  (:mod:`autoremat.plan_offload`); ``offload_waits`` is an object of node id (digits) -> unit id,
  and every unit it waits for is offloaded; ``offload_order``, when given, lists the units once each;
  ``offload_calls`` maps such a node (digits) to the one call of a shared module it is in
  (``"<path>@<k>/<n>"``).
* Segments must be non-empty and disjoint; when the plan names its graph's nodes
  (``node_names``), every node id must be below their number and the segments must
  cover them all. Whether segments are lower sets of the model's graph is checked against the
  model by :func:`autoremat.apply` / :func:`autoremat.validate_plan`.
* :func:`load_plan_json` reads JSON text when the first non-blank character is ``{`` or ``[``,
  and a file otherwise; text that is neither valid JSON nor an existing file is refused with
  both readings named.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from .call_names import is_per_call
from .errors import PlanFormatError

__all__ = ["check_plan_dict", "load_plan_json", "PLAN_KEYS", "SEGMENT_KEYS", "SEGMENT_OPTIONAL_KEYS", "GRAPH_KEYS",
           "READ_VERSIONS"]

GRAPH_KEYS = ("graph_mode", "node_names", "replay_tails", "tensors", "inputs")
"""Top-level fields of format 2 that format 1 kept in ``options``."""
PLAN_KEYS = frozenset({"format", "version", "segments", "solver", "options", "budget_bytes",
                       "graph_fingerprint", "predicted_peak_bytes", "predicted_extra_time_s", "offload",
                       "offload_saved", "offload_waits", "offload_order", "offload_prefetch_depth",
                       "bandwidth_bytes_per_s", "module_calls", "offload_calls", *GRAPH_KEYS})
SEGMENT_KEYS = frozenset({"nodes", "recompute"})
SEGMENT_OPTIONAL_KEYS = frozenset({"keep"})
READ_VERSIONS = (1, 2)
"""The plan formats this autoremat reads."""


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _node_id(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanFormatError(field, f"expected a node id (an integer >= 0), got {value!r} ({_kind(value)})")
    if value < 0:
        raise PlanFormatError(field, f"expected a node id (an integer >= 0), got {value}")
    return value


def _unit_id(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanFormatError(field, f"expected an offload unit id (an integer: a node id, or -1 - w for node w of "
                              f"offload_saved), got {value!r} ({_kind(value)})")
    return value


def _node_list(field: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):  # tuples: an in-memory dict (Lightning state), not JSON
        raise PlanFormatError(field, f"expected a list of node ids, got {value!r} ({_kind(value)})")
    return [_node_id(f"{field}[{j}]", v) for j, v in enumerate(value)]


def _opt_bytes(field: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanFormatError(field, f"expected a number of bytes (an integer >= 0) or null, got {value!r}")


def _opt_seconds(field: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PlanFormatError(field, f"expected a time in seconds (a finite number >= 0) or null, got {value!r}")


def _string(field: str, value: Any) -> None:
    if not isinstance(value, str):
        raise PlanFormatError(field, f"expected a string, got {value!r} ({_kind(value)})")


def _segments(value: Any, num_nodes: int | None) -> None:
    if not isinstance(value, (list, tuple)):
        raise PlanFormatError("segments", f"expected a list of {{'nodes': [...], 'recompute': true/false}} "
                                          f"objects, got {_kind(value)}")
    owner: dict[int, int] = {}
    for i, seg in enumerate(value):
        field = f"segments[{i}]"
        if not isinstance(seg, Mapping):
            raise PlanFormatError(field, f"expected an object with keys 'nodes' and 'recompute', got {_kind(seg)}")
        for key in sorted(SEGMENT_KEYS - set(seg)):
            raise PlanFormatError(f"{field}.{key}", "required key is missing "
                                  "(a segment is {'nodes': [node ids], 'recompute': true or false})")
        for key in sorted(set(seg) - SEGMENT_KEYS - SEGMENT_OPTIONAL_KEYS):
            raise PlanFormatError(f"{field}.{key}", f"unknown key; a segment has only "
                                  f"{sorted(SEGMENT_KEYS | SEGMENT_OPTIONAL_KEYS)}")
        if not isinstance(seg["recompute"], bool):
            raise PlanFormatError(f"{field}.recompute", f"expected a JSON boolean (true or false), got "
                                  f"{seg['recompute']!r} ({_kind(seg['recompute'])})")
        nodes = _node_list(f"{field}.nodes", seg["nodes"])
        if not nodes:
            raise PlanFormatError(f"{field}.nodes", "a segment must hold at least one node")
        keep = _node_list(f"{field}.keep", seg.get("keep", []))
        if keep and not seg["recompute"]:
            raise PlanFormatError(f"{field}.keep", "only a recomputed segment keeps op outputs")
        if not set(keep) <= set(nodes):
            raise PlanFormatError(f"{field}.keep", f"nodes {sorted(set(keep) - set(nodes))[:5]} are not in the segment")
        for v in nodes:
            if num_nodes is not None and v >= num_nodes:
                raise PlanFormatError(f"{field}.nodes", f"node {v} is out of range: the plan's graph has "
                                      f"{num_nodes} nodes (node_names), ids 0..{num_nodes - 1}")
            if v in owner:
                where = "twice in this segment" if owner[v] == i else f"also in segments[{owner[v]}]"
                raise PlanFormatError(f"{field}.nodes", f"node {v} is {where}; every node belongs to exactly "
                                      "one segment")
            owner[v] = i
    if num_nodes is not None and len(owner) != num_nodes:
        missing = sorted(set(range(num_nodes)) - set(owner))
        raise PlanFormatError("segments", f"the segments do not cover the graph's {num_nodes} nodes; missing "
                              f"{missing[:10]}{' …' if len(missing) > 10 else ''}")


def _graph_fields(doc: Mapping[str, Any], where: str) -> int | None:
    """Check the graph fields found in ``doc`` (the plan, or its ``options`` for format 1);
    ``where`` prefixes the field names. Returns the number of graph nodes when it names them."""
    mode = doc.get("graph_mode")
    if mode is not None:
        _string(f"{where}graph_mode", mode)
    names = doc.get("node_names")
    if names is not None:
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise PlanFormatError(f"{where}node_names", "expected a list of node names (strings), one per graph node")
    tails = doc.get("replay_tails")
    if tails is not None:
        if not isinstance(tails, Mapping):
            raise PlanFormatError(f"{where}replay_tails", f"expected an object, got {_kind(tails)}")
        for k, tail in tails.items():
            field = f"{where}replay_tails.{k}"
            if not str(k).isdigit():
                raise PlanFormatError(field, "expected a segment index (digits) as the key")
            if not isinstance(tail, (list, tuple)) or len(tail) != 2:
                raise PlanFormatError(field, "expected [first node of the tail, [tail input node ids]]")
            _node_id(f"{field}[0]", tail[0])
            _node_list(f"{field}[1]", tail[1])
    tensors = doc.get("tensors")
    if tensors is not None and (not isinstance(tensors, Mapping)
                                or not all(isinstance(k, str) and isinstance(v, str) for k, v in tensors.items())):
        raise PlanFormatError(f"{where}tensors", "expected an object of tensor name -> 'dtype[shape]' strings "
                              "(written by autoremat.solve)")
    inputs = doc.get("inputs")
    if inputs is not None:
        if not isinstance(inputs, (list, tuple)):
            raise PlanFormatError(f"{where}inputs", f"expected a list of input descriptions, got {_kind(inputs)}")
        for j, spec in enumerate(inputs):
            field = f"{where}inputs[{j}]"
            if not isinstance(spec, Mapping) or not {"path", "shape", "dtype", "device"} <= set(spec):
                raise PlanFormatError(field, "expected {'path', 'shape', 'dtype', 'device'} (written by autoremat.solve)")
            if not isinstance(spec["shape"], (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                              for d in spec["shape"]):
                raise PlanFormatError(f"{field}.shape", f"expected a list of integers, got {spec['shape']!r}")
            for key in ("path", "dtype", "device"):
                _string(f"{field}.{key}", spec[key])
    return None if names is None else len(names)


def _options(data: Mapping[str, Any]) -> int | None:
    """Check ``options`` and the graph fields (top level, or in ``options`` as format 1 kept
    them); returns the number of graph nodes when the plan names them."""
    value = data.get("options", {})
    if not isinstance(value, Mapping):
        raise PlanFormatError("options", f"expected an object (solver options and graph identity), got {_kind(value)}")
    for key in GRAPH_KEYS:
        if data.get(key) is not None and value.get(key) is not None:
            raise PlanFormatError(f"options.{key}", f"given both at the top level and in options (where plan format "
                                  "1 kept it); keep one")
    in_options = _graph_fields(value, "options.")
    top = _graph_fields(data, "")
    return top if top is not None else in_options


def _bandwidth(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PlanFormatError("bandwidth_bytes_per_s", f"expected bytes per second (a finite number > 0) or null, "
                              f"got {value!r}")


def _entries(name: str, value: Any, what: str) -> list[tuple[Any, Any]]:
    """The items of optional object field ``name`` (``what``: its keys and values, for the error)."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise PlanFormatError(name, f"expected an object ({what}), got {_kind(value)}")
    return list(value.items())


def _module_calls(value: Any, num_segments: int) -> None:
    for k, call in _entries("module_calls", value, "segment index -> module call"):
        field = f"module_calls.{k}"
        if not str(k).isdigit() or int(k) >= num_segments:
            raise PlanFormatError(field, f"expected a segment index below {num_segments} as the key")
        if not isinstance(call, Mapping) or set(call) != {"path", "keep_ops", "keep_names"}:
            raise PlanFormatError(field, "expected {'path', 'keep_ops', 'keep_names'} (written by autoremat.solve)")
        _string(f"{field}.path", call["path"])
        ops = call["keep_ops"]
        if not isinstance(ops, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                         for i in ops):
            raise PlanFormatError(f"{field}.keep_ops", f"expected a list of op indices (integers >= 0), got {ops!r}")
        names = call["keep_names"]
        if not isinstance(names, (list, tuple)) or len(names) != len(ops) or not all(isinstance(n, str) for n in names):
            raise PlanFormatError(f"{field}.keep_names", "expected one op name (a string) per entry of keep_ops")


def _offload_calls(value: Any, nodes: set[int]) -> None:
    for k, call in _entries("offload_calls", value, "node id -> module call"):
        field = f"offload_calls.{k}"
        if not str(k).isdigit() or int(k) not in nodes:
            raise PlanFormatError(field, f"expected a node of offload, offload_saved or offload_waits as the key "
                                  f"(those are {sorted(nodes)[:10]})")
        if not isinstance(call, str) or not is_per_call(call):
            raise PlanFormatError(field, f"expected one call of a module run more than once per step, "
                                  f"'<path>@<k>/<n>', got {call!r}")


def check_plan_dict(data: Any, *, source: str | None = None) -> None:
    """Raise :class:`PlanFormatError` unless ``data`` is a well-formed plan document."""
    try:
        _check(data)
    except PlanFormatError as err:
        if source is None:
            raise
        raise PlanFormatError(err.field, err.problem, source=source) from None


def _check(data: Any) -> None:
    from .plan import PLAN_FORMAT_VERSION

    if not isinstance(data, Mapping):
        raise PlanFormatError("", f"expected a JSON object with format='autoremat.plan', got {_kind(data)}")
    if data.get("format") != "autoremat.plan":
        raise PlanFormatError("format", f"not an autoremat plan: expected 'autoremat.plan', got "
                              f"{data.get('format')!r} (a file written by Plan.to_json)")
    if "version" not in data:
        raise PlanFormatError("version", f"required key is missing (this autoremat reads version {PLAN_FORMAT_VERSION})")
    if data["version"] not in READ_VERSIONS or isinstance(data["version"], bool):
        raise PlanFormatError("version", f"plan format version {data['version']!r} is not supported "
                              f"(this autoremat reads versions {', '.join(map(str, READ_VERSIONS))}); solve the "
                              "model again")
    if data["version"] == 1:
        for key in sorted(set(GRAPH_KEYS) & set(data)):
            raise PlanFormatError(key, "a top-level key of plan format 2, in a version 1 document (format 1 kept it "
                                  "in options); write the plan again with Plan.to_json")
    if "segments" not in data:
        raise PlanFormatError("segments", "required key is missing (a list of {'nodes': [...], 'recompute': bool})")
    for key in sorted(set(data) - PLAN_KEYS):
        raise PlanFormatError(str(key), f"unknown key; a plan has only {sorted(PLAN_KEYS)}")
    for key in ("solver", "graph_fingerprint"):
        if key in data:
            _string(key, data[key])
    num_nodes = _options(data)
    _bandwidth(data.get("bandwidth_bytes_per_s"))
    _segments(data["segments"], num_nodes)
    _module_calls(data.get("module_calls"), len(data["segments"]))
    _opt_bytes("budget_bytes", data.get("budget_bytes"))
    _opt_bytes("predicted_peak_bytes", data.get("predicted_peak_bytes"))
    _opt_seconds("predicted_extra_time_s", data.get("predicted_extra_time_s"))
    offload = _node_list("offload", data.get("offload", []))
    saved = _node_list("offload_saved", data.get("offload_saved", []))
    if num_nodes is not None:
        for name, nodes in (("offload", offload), ("offload_saved", saved)):
            for j, v in enumerate(nodes):
                if v >= num_nodes:
                    raise PlanFormatError(f"{name}[{j}]", f"node {v} is out of range: the plan's graph has "
                                          f"{num_nodes} nodes")
    units = set(offload) | {-1 - v for v in saved}
    _offload_waits(data.get("offload_waits"), units, num_nodes)
    waits = data.get("offload_waits") or {}
    _offload_calls(data.get("offload_calls"), set(offload) | set(saved) | {int(v) for v in waits})
    order = data.get("offload_order", [])
    if not isinstance(order, (list, tuple)):
        raise PlanFormatError("offload_order", f"expected a list of unit ids, got {order!r} ({_kind(order)})")
    order = [_unit_id(f"offload_order[{j}]", v) for j, v in enumerate(order)]
    if order and sorted(order) != sorted(units):
        raise PlanFormatError("offload_order", f"must list every offloaded unit once (the order of first backward "
                              f"use; -1 - w for node w of offload_saved), got {order[:10]} for units "
                              f"{sorted(units)[:10]}")
    depth = data.get("offload_prefetch_depth", 1)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise PlanFormatError("offload_prefetch_depth", f"expected an int >= 1 (how many offloaded storages backward "
                              f"prefetches ahead of their first use), got {depth!r}")


def _offload_waits(value: Any, offload: set[int], num_nodes: int | None) -> None:
    """``offload_waits``: node id (digits) -> an offloaded node id."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise PlanFormatError("offload_waits", f"expected an object of node id -> offloaded node id (the forward "
                              f"waits before the node for that node's copy to host), got {_kind(value)}")
    for k, r in value.items():
        field = f"offload_waits.{k}"
        if isinstance(k, bool) or not (isinstance(k, int) or str(k).isdigit()):
            raise PlanFormatError(field, f"expected a node id (digits) as the key, got {k!r}")
        if num_nodes is not None and int(k) >= num_nodes:
            raise PlanFormatError(field, f"node {k} is out of range: the plan's graph has {num_nodes} nodes")
        if _unit_id(field, r) not in offload:
            raise PlanFormatError(field, f"waits for the copy of unit {r}, which the plan does not offload "
                                  f"({sorted(offload)[:10]}); add it there or drop the wait")


def load_plan_json(text_or_path: Any) -> tuple[Any, str | None]:
    """Parse a plan from JSON text or a file; returns ``(data, source)`` where ``source`` is the
    file path (``None`` for text). Errors are :class:`PlanFormatError`."""
    if isinstance(text_or_path, os.PathLike):
        text_or_path = os.fspath(text_or_path)
    if not isinstance(text_or_path, str):
        raise PlanFormatError("", f"expected JSON text or a path to a plan file, got {_kind(text_or_path)}")
    head = text_or_path.lstrip()[:1]
    source: str | None = None
    text = text_or_path
    if head not in ("{", "["):
        source = text_or_path
        try:
            with open(text_or_path, encoding="utf-8") as f:
                text = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            shown = text_or_path if len(text_or_path) <= 80 else text_or_path[:77] + "..."
            raise PlanFormatError("", f"{shown!r} is neither JSON text (which starts with '{{') nor an existing "
                                  "plan file; give the path of a file written by Plan.to_json or "
                                  "`autoremat plan --out`") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanFormatError("", f"cannot read the plan file {text_or_path!r}: {exc}") from None
    try:
        return json.loads(text), source
    except json.JSONDecodeError as exc:
        raise PlanFormatError("", f"not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                              "a truncated or hand-edited file? write it again with Plan.to_json",
                              source=source) from None
