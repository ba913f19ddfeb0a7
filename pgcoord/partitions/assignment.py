"""Which member should own which part: balanced, and sticky to the current owners.

Every participant computes the assignment on its own from the same two facts,
read in one statement: the live participants and the current owner of each part.
The result must therefore be a pure function of those facts.

Balance: with M members and N parts, N mod M members get ⌈N/M⌉ parts and the
rest ⌊N/M⌋. Stickiness: a live owner keeps its parts up to its share, so a join
moves exactly the parts the newcomer needs, and a leave moves exactly the parts
of the member that left. That is the minimum any balanced scheme can move.
Parts that must find an owner go to the member that ranks them highest, among
those with room (rendezvous hashing), so that what moves is spread evenly.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Mapping

__all__ = ["balanced", "score"]


def score(name: str, index: int, member: str) -> int:
    """How much ``member`` wants part ``index`` of ``name``: the same in every process."""
    digest = hashlib.blake2b(f"{name}\x00{index}\x00{member}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def balanced(name: str, count: int, members: Iterable[str], owners: Mapping[int, str]) -> dict[int, str]:
    """``{index: member}`` for every part, given the live ``members`` and the current
    ``owners`` (owners that are not live members are ignored)."""
    live = sorted(set(members))
    if not live:
        return {}
    base, extra = divmod(count, len(live))
    kept: dict[str, list[int]] = collections.defaultdict(list)
    for index, owner in owners.items():
        if owner in kept or owner in live:
            kept[owner].append(index)
    # The larger shares go to the members that already hold the most, so that a
    # change of share moves nothing it need not. Ties: by rendezvous score.
    ranked = sorted(live, key=lambda m: (-min(len(kept.get(m, ())), base + 1), -score(name, -1, m), m))
    share = {member: base + (1 if rank < extra else 0) for rank, member in enumerate(ranked)}
    result: dict[int, str] = {}
    load: collections.Counter[str] = collections.Counter()
    for owner, indexes in kept.items():
        # An owner above its share keeps the parts it ranks highest.
        indexes.sort(key=lambda i: score(name, i, owner), reverse=True)
        for index in indexes[: share[owner]]:
            result[index] = owner
            load[owner] += 1
    for index in range(count):
        if index in result:
            continue
        for member in sorted(live, key=lambda m: score(name, index, m), reverse=True):
            if load[member] < share[member]:
                result[index] = member
                load[member] += 1
                break
    return result
