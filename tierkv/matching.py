"""Matching: the longest chain of stored blocks for a request's token ids.

Every lookup, acquire and pin starts here, under the placement lock. It reads the block
table (through the placement's chain memo where a prefix was hashed before) and moves
nothing, except that a block whose stored token ids differ from the request's is
quarantined. It was ``Placement.match`` until issue #32: placement.py is the code that moves
pages, and needed the room for its fault points.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, cast

from .blocks import Block
from .identity import iter_block_keys, same_bytes

if TYPE_CHECKING:
    import numpy as np

    from .identity import Scope
    from .placement import Placement


def match_chain(placement: "Placement", arr: "np.ndarray", scope: "Scope",
                block_extra: "Sequence[Sequence[str | bytes]] | None") -> list[Block]:
    """The longest chain of stored blocks for ``arr`` whose token ids equal the request's
    (held: ``placement.lock``). A block whose stored ids differ is a collision or a corrupt
    record: quarantined, and the chain ends there. Keys of a prefix hashed before
    (byte-equal tokens, same seed) come from the chain memo, and their blocks' stored ids
    are compared in one piece (a mismatch: the block-by-block walk)."""
    bs = placement.layout.block_size
    step = 4 * bs
    raw = arr.data.cast("B")  # a view: tobytes() of each prompt was a replay's page faults
    get = placement.table.blocks.get
    memo = placement.chain_memo if block_extra is None else None
    proven = memo.proven(scope.seed, raw, step, len(raw) // step) if memo is not None else ()
    chain: list[Block] = []
    if proven:  # a miss inside it ends the chain; stored ids disagreeing: hash and walk
        found: list[Block | None] = list(map(get, proven))  # no block in the table is dead (check_integrity)
        if None in found:
            del found[found.index(None):]
        chain = cast("list[Block]", found)  # free at run time; compiled, a check that it is a list
        if not same_bytes(b"".join([b.tokens for b in chain]), raw[: len(chain) * step]):
            chain, proven = [], ()
        elif len(chain) < len(proven):
            return chain
    hashed = list(proven)  # every key computed, the first miss's too (a put needs it next)
    for i, key in enumerate(iter_block_keys(arr, scope.seed, bs, block_extra, start=len(proven),
                                            parent=proven[-1] if proven else None, raw=raw), len(proven)):
        hashed.append(key)
        b = get(key)
        if b is None or b.dead:
            break
        if not same_bytes(b.tokens, raw[i * step : (i + 1) * step]):
            placement.stats_counters.token_mismatch += 1
            placement.quarantine(b, "stored token ids differ from the request's")
            break
        chain.append(b)
    # Only the first miss hashed: the put re-hashes it rather than the memo copy the prefix.
    if memo is not None and len(hashed) > len(proven) + 1:
        memo.remember(scope.seed, raw, step, hashed)
    return chain
