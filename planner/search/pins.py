"""Pinned choices: ``plan --tp 8 --micro-batch 2 ...`` fixes those outer choices and the search proves the best
plan under them (the ILP still chooses stages and layouts; the outer pins only narrow the outer candidates).
``--recompute MODE`` is the one inner pin: every transformer block's recompute option is that mode
(:meth:`planner.search.costs.CostTables.options`; the embedding and head keep their searched choice).

A pin is a field of :class:`planner.search.space.OuterChoice`; a family of expert layouts keeps the members the
pins allow. Pinning cannot make a plan faster than the unpinned optimum: the plan's optimality claim is "under the
pins", and its notes name them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from planner.core import StratagemError
from planner.search.space import OuterChoice

# flag name -> OuterChoice field (the same words as `estimate`'s flags)
PIN_FIELDS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "ep": "ep",
    "zero": "zero_stage",
    "micro_batch": "micro_batch",
    "schedule": "schedule",
}
INNER_PINS = ("recompute",)  # pinned inside the ILP, not on the outer candidates
PIN_FLAGS = (*PIN_FIELDS, *INNER_PINS)  # every pin flag, in the order the CLI reads them


def _member_ok(choice: OuterChoice, pins: Mapping[str, object]) -> bool:
    return all(getattr(choice, PIN_FIELDS[k]) == v for k, v in pins.items() if k in PIN_FIELDS)


def apply_pins(outers: Iterable[OuterChoice], pins: Mapping[str, object]) -> list[OuterChoice]:
    """The candidates whose choices equal every pin (families narrowed to their allowed expert layouts)."""
    outers = list(outers)
    if not any(k in PIN_FIELDS for k in pins):
        return outers
    kept = []
    for outer in outers:
        if outer.expert_family:
            family = tuple((ep, etp) for ep, etp in outer.expert_family if _member_ok(replace(outer, ep=ep), pins))
            if family:
                kept.append(replace(outer, expert_family=family) if len(family) > 1 else _one(outer, family[0]))
        elif _member_ok(outer, pins):
            kept.append(outer)
    return kept


def _one(outer: OuterChoice, layout: tuple[int, int]) -> OuterChoice:
    return replace(outer, ep=layout[0], etp=layout[1], expert_family=())


def check_pins_left_some(before: list[OuterChoice], after: list[OuterChoice], pins: Mapping[str, object]) -> None:
    """A one-line error naming the pin that left no candidate, with the values the others could take."""
    if after or not pins:
        return
    for key, value in pins.items():
        if key not in PIN_FIELDS:
            continue
        field = PIN_FIELDS[key]
        seen = {getattr(o, field) for o in before}
        seen |= {ep for o in before for ep, _ in o.expert_family} if key == "ep" else set()
        values = sorted(seen) if all(isinstance(v, int) for v in seen) else sorted(seen, key=str)
        if value not in values:
            flag = "--" + key.replace("_", "-")
            raise StratagemError(
                f"{flag} {value} leaves no candidate (this model, cluster, device count and global batch allow "
                f"{flag} {', '.join(map(str, values))}); pick one of those or drop {flag}"
            )
    shown = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in pins.items())
    raise StratagemError(f"{shown} together leave no candidate; drop one of them")


def pins_note(pins: Mapping[str, object]) -> str:
    """The plan's note: what was pinned, and that the proof holds under the pins only."""
    shown = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in pins.items())
    return f"pinned {shown}: the proof holds under these pins, not over every plan"
