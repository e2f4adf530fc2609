"""Trees an origin plans once and its large chunks carry (``PLANNED_CHUNK``).

Without a carried plan every relay forwards a chunk by the trees of the published
state it holds when the chunk reaches it. For a small chunk that is what one wants: it
spends milliseconds per hop and the state does not move under it. A 1 MiB piece on a
slow link spends seconds per hop, and RTTs and rates are republished meanwhile: on the
emulated multi-cloud matrix 30-82 tree changes happened per large round, a node that
no relay's tree (at that relay's time) sent a piece to fetched it by repair, and a
repair that crossed a late tree copy cost a second MiB on a slow link (docs/
benchmarks.md, "the repair wait follows the tree's lag"). So an origin's large pieces
name the tree it planned, signed with them, and every relay of one piece follows
that one plan.

What a relay does with a plan (:func:`plan_children`): it sends to the nodes the plan
makes its children; one it believes dead is replaced by that node's own children
(recursively), so a dead relay's subtree is still served. A node the plan does not
name forwards nothing (it joined after the origin planned; the planned nodes get the
piece down the plan). A plan is its origin's word about its own chunks only: its
signature keeps relays from changing it, and a relay follows it to at most one child
more than its own tree gives it (core.mesh.broadcast; where views differ, honest
plans move a copy from one relay to another), so a member can make a node send each
of its pieces to at most one member more than routing would, and every node holds a
plan within ``chunk_retain_bytes`` (core.mesh.chunkstore counts it). Only a piece over
64 KiB carries one (core.mesh.messages refuses it on a smaller payload).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from ciuic_p2p.core.mesh.messages import MAX_ID_BYTES, MAX_PLAN_BYTES, MAX_PLAN_NODES, Plan


def plan_from_tree(tree: Mapping[str, Sequence[str]], origin: str) -> Plan:
    """``origin``'s tree (children per node) as a carried plan, breadth first from the
    origin; empty if it names more than ``MAX_PLAN_NODES`` nodes or does not fit
    ``MAX_PLAN_BYTES`` (then each relay forwards by its own trees)."""
    index = {origin: 0}
    plan: list[tuple[str, int]] = []
    size = 1
    queue = [origin]
    for parent in queue:
        for child in tree.get(parent, ()):
            if child in index:
                continue
            encoded = len(child.encode())
            if encoded > MAX_ID_BYTES:
                return ()
            size += 2 + encoded
            plan.append((child, index[parent]))
            index[child] = len(plan)
            queue.append(child)
    if len(plan) > MAX_PLAN_NODES or size > MAX_PLAN_BYTES:
        return ()
    return tuple(plan)


def plan_children(plan: Plan, origin: str, node: str, live: Collection[str]) -> list[str] | None:
    """Whom ``node`` sends a chunk of this plan to: its children in the plan, each one
    not in ``live`` replaced by its own children; None if the plan does not name
    ``node``. A decoded plan names each node once, after its parent
    (core.mesh.messages), so this visits each entry at most once."""
    if node == origin:
        me = 0
    else:
        found = next((i for i, (name, _) in enumerate(plan, 1) if name == node), None)
        if found is None:
            return None
        me = found
    kids_of: dict[int, list[int]] = {}
    for i, (_, parent) in enumerate(plan, 1):
        kids_of.setdefault(parent, []).append(i)
    out: list[str] = []
    stack = list(reversed(kids_of.get(me, [])))
    while stack:
        i = stack.pop()
        name = plan[i - 1][0]
        if name in live:
            out.append(name)
        else:
            stack.extend(reversed(kids_of.get(i, [])))
    return out


def plan_parent(plan: Plan, origin: str, node: str, live: Collection[str]) -> str | None:
    """Who sends ``node`` a chunk of this plan (:func:`plan_children` the other way
    round): its parent in the plan, or the nearest one above it in ``live``; None if
    the plan does not name ``node`` or ``node`` is the origin."""
    if node == origin:
        return None
    found = next((i for i, (name, _) in enumerate(plan, 1) if name == node), None)
    if found is None:
        return None
    parent = plan[found - 1][1]
    for _ in range(len(plan)):  # a decoded plan names each parent before its children
        if parent == 0:
            return origin
        name, above = plan[parent - 1]
        if name in live:
            return name
        parent = above
    return None


__all__ = ["plan_children", "plan_from_tree", "plan_parent"]
