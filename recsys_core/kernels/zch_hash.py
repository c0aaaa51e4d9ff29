"""Multi-probe zero-collision hashing (FBGEMM's ``zero_collision_hash``) in vectorised torch.

An identity table ``identities`` (shape ``[size, 1]``, ``-1`` = empty) holds the raw id that owns
each slot. An id hashes (64-bit MurmurHash3, as FBGEMM) to a start position inside its bucket
and probes forward, circularly within the bucket, up to ``max_probe`` slots::

    bucket of 8 slots, id 42 hashes to 5, max_probe 4:   probes 5, 6, 7, 0
    identities  [ 7 -1 -1 -1 -1 13 42 -1 ]   -> 42 owns slot 6 (hit)
    id 99 hashes to 5: 5 is 13's, 6 is 42's, 7 is empty -> 99 takes slot 7 (insert, training)

An id found within its probes maps to its slot. In training an id not found takes the first
empty slot on its probe path, or (with eviction) an expired slot; in read-only mode (eval,
inference) it falls back to ``hash % size`` (or ``-1`` with ``disable_fallback``).

Positions, fallbacks and identity layout equal FBGEMM's (its CPU read-only op is the test
oracle), so identity tables move between the two. FBGEMM's CUDA kernel inserts concurrently
(which of two new ids racing for one slot wins is unspecified); here the id that appears first
in the batch wins, so a run is deterministic. No Python loop runs per id: each round is a few
tensor ops over all unresolved ids, and rounds continue only while ids compete for a slot.
"""

from __future__ import annotations

import torch

EMPTY = -1  # an empty slot's identity

# MurmurHash3 x64 constants are written below as signed 64-bit literals (torch has no uint64
# arithmetic; TorchScript reads no module globals): 0x87c37b91114253d5, 0x4cf5ad432745937f,
# 0xff51afd7ed558ccd, 0xc4ceb9fe1a85ec53.

__all__ = ["EMPTY", "murmur_hash3", "unsigned_mod", "zero_collision_hash"]


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of the 64-bit pattern (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x << r) | _shr(x, 64 - r)


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _shr(h, 33)
    h = h * -49064778989728563
    h = h ^ _shr(h, 33)
    h = h * -4265267296055464877
    return h ^ _shr(h, 33)


def murmur_hash3(x: torch.Tensor) -> torch.Tensor:
    """FBGEMM's ``murmur_hash3_2x64(x, 0, 0)`` of each int64 id; the uint64 result's bit
    pattern as int64."""
    k1 = _rotl(x.to(torch.int64) * -8663945395140668459, 31) * 5545529020109919103
    h1 = _rotl(k1, 27)  # seed 0: h1 = 0 ^ k1, then rotated; h2 is still 0
    h1 = h1 * 5 + 0x52DCE729
    # Second block with y = 0: k2 = 0, so h2 = rotl(0, 31) + h1 = h1.
    h2 = h1 * 5 + 0x38495AB5
    h1 = h1 ^ 16
    h2 = h2 ^ 16
    h1 = h1 + h2
    h2 = h2 + h1
    h1 = _fmix(h1)
    h2 = _fmix(h2)
    h1 = h1 + h2
    h2 = h2 + h1
    return h1 ^ h2


def unsigned_mod(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``h % m`` reading ``h`` as uint64 (``0 < m < 2**31``), as FBGEMM's ``hash % size``."""
    hi = _shr(h, 32)
    lo = h & 0xFFFFFFFF
    two32 = torch.full_like(m, 1 << 32) % m
    return ((hi % m) * two32 + lo % m) % m


def _first_true(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether any column is True, and the first True column (0 when none)."""
    found = mask.any(dim=1)
    width = mask.size(1)
    cols = torch.arange(width, device=mask.device).unsqueeze(0).expand_as(mask)
    first = torch.where(mask, cols, torch.full_like(cols, width)).amin(dim=1)
    return found, torch.where(found, first, torch.zeros_like(first))


def zero_collision_hash(
    values: torch.Tensor,
    identities: torch.Tensor,
    max_probe: int,
    readonly: bool,
    local_sizes: torch.Tensor | None,
    offsets: torch.Tensor | None,
    metadata: torch.Tensor | None,
    disable_fallback: bool,
    input_metadata: torch.Tensor | None,
    eviction_threshold: int,
    eviction_policy: int,
    opt_in_prob: int,
    num_reserved_slots: int,
    opt_in_rands: torch.Tensor | None,
    runtime_meta: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Remap ``values`` (int64 ids) to slots of ``identities``, inserting in training.

    ``local_sizes`` / ``offsets`` (one per id) give each id's bucket; without them the bucket is
    the whole table. ``metadata`` (int32 ``[size, 1]``, training with eviction only) holds each
    slot's score: ``input_metadata`` of the id that last touched it. A slot is evictable for a
    new id when ``eviction_threshold > metadata`` and ``metadata < input_metadata``; policy 0
    takes the first evictable slot on the probe path (when the id is not already present),
    policy 1 (LRU) fills an empty slot on the path or else the evictable slot with the smallest
    metadata. ``opt_in_prob`` in (0, 100] with ``num_reserved_slots`` keeps that many slots at
    the end of each bucket for ids not opted in (``opt_in_rands >= opt_in_prob``). With
    ``runtime_meta`` (``[size, 1]`` int64) each lookup of a slot in training adds one to its
    count, and an evicted slot's count restarts.

    Returns the slots (int64, ``-1`` for a miss with ``disable_fallback``) and, in training with
    eviction, the slots whose previous owner was evicted (else None).
    """
    device = values.device
    n = values.numel()
    size = identities.size(0)
    ids = values.to(torch.int64)
    evicting = (not readonly) and metadata is not None and (
        eviction_threshold > 0 or eviction_policy > 0
    )
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, (empty if evicting else None)
    if local_sizes is None:
        modulo = torch.full((n,), size, dtype=torch.int64, device=device)
    else:
        modulo = local_sizes.to(torch.int64)
    if offsets is None:
        base = torch.zeros(n, dtype=torch.int64, device=device)
    else:
        base = offsets.to(torch.int64)
    reserved = num_reserved_slots if opt_in_prob != -1 else 0
    block = modulo - reserved
    hashed = murmur_hash3(ids)
    start = unsigned_mod(hashed, block)
    if opt_in_prob == -1:
        fallback = unsigned_mod(hashed, modulo) + base
    else:
        fallback = block + unsigned_mod(hashed, torch.full_like(block, max(reserved, 1))) + base
    flat = identities.view(-1)

    # One lookup per distinct id; ties between new ids go to the earliest occurrence.
    uniq, inverse = torch.unique(ids, return_inverse=True)
    u = uniq.numel()
    positions = torch.arange(n, device=device)
    first = torch.full((u,), n, dtype=torch.int64, device=device).scatter_reduce(
        0, inverse, positions, reduce="amin", include_self=True
    )
    u_start, u_block, u_base = start[first], block[first], base[first]
    u_fallback = fallback[first]
    u_meta = torch.zeros(u, dtype=torch.int32, device=device)
    if input_metadata is not None:
        u_meta = u_meta.scatter_reduce(
            0, inverse, input_metadata.to(torch.int32), reduce="amax", include_self=False
        )

    probes = max(max_probe, 1)
    steps = torch.arange(probes, device=device).unsqueeze(0)
    window = u_base.unsqueeze(1) + (u_start.unsqueeze(1) + steps) % u_block.unsqueeze(1)
    owners = flat[window]
    hit_mask = owners == uniq.unsqueeze(1)
    if not readonly:
        # Training stops at the first empty slot (an id is never placed beyond one).
        seen_empty = (owners == -1).to(torch.int64).cumsum(dim=1) > 0
        hit_mask = hit_mask & ~seen_empty
    found, col = _first_true(hit_mask)
    slot = torch.where(found, window.gather(1, col.unsqueeze(1)).squeeze(1), u_fallback)
    evicted: torch.Tensor | None = None

    if not readonly:
        opted_in = torch.ones(u, dtype=torch.bool, device=device)
        if opt_in_rands is not None and opt_in_prob > 0 and opt_in_prob < 100:
            u_rand = opt_in_rands.to(torch.int64)[first]
            opted_in = u_rand < opt_in_prob
            # Ids not opted in share the reserved slots (their hash position there).
            slot = torch.where(~found & ~opted_in, u_fallback, slot)
        new = (~found & opted_in).nonzero().view(-1)
        if new.numel() > 0:
            slot, evicted = _insert(
                flat, metadata, uniq, first, u_meta, window, new, slot, evicting,
                eviction_threshold, eviction_policy,
            )
        if metadata is not None:
            touched = found | ~opted_in
            md = metadata.view(-1)
            md.scatter_reduce_(0, slot[touched], u_meta[touched], reduce="amax")
        if runtime_meta is not None:
            counts = runtime_meta.view(-1)
            if evicted is not None and evicted.numel() > 0:
                counts[evicted] = 0
            per_id = torch.bincount(inverse, minlength=u).to(counts.dtype)
            counts.index_add_(0, slot, per_id)

    out = slot[inverse]
    if disable_fallback:
        out = torch.where(flat[out] == ids, out, torch.full_like(out, -1))
    if evicting and evicted is None:
        evicted = torch.empty(0, dtype=torch.int64, device=device)
    return out, evicted


def _insert(
    flat: torch.Tensor,
    metadata: torch.Tensor | None,
    uniq: torch.Tensor,
    first: torch.Tensor,
    u_meta: torch.Tensor,
    window: torch.Tensor,
    new: torch.Tensor,
    slot: torch.Tensor,
    evicting: bool,
    eviction_threshold: int,
    eviction_policy: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Place the ids ``new`` (indices into ``uniq``): rounds of claims on each id's next free
    (or evictable) slot; a slot claimed by several ids goes to the earliest in the batch, the
    others move on. Returns the updated slots and the slots whose owner was evicted."""
    device = flat.device
    md: torch.Tensor | None = metadata.view(-1) if metadata is not None else None
    win = window[new]
    meta = u_meta[new]
    rank = first[new]
    probes = win.size(1)
    lru = evicting and eviction_policy == 1
    evicted_parts = [torch.empty(0, dtype=torch.int64, device=device)]
    # Round 1 claims an empty slot (or, for threshold eviction, an evictable one) on the path.
    cursor = torch.zeros(new.numel(), dtype=torch.int64, device=device)
    active = torch.ones(new.numel(), dtype=torch.bool, device=device)
    while bool(active.any()):
        owners = flat[win]
        claimable = owners == -1
        if evicting and not lru and md is not None:
            score = md[win]
            claimable = claimable | ((eviction_threshold > score) & (score < meta.unsqueeze(1)))
        cols = torch.arange(probes, device=device).unsqueeze(0)
        claimable = claimable & (cols >= cursor.unsqueeze(1)) & active.unsqueeze(1)
        has, col = _first_true(claimable)
        if not bool(has.any()):
            break
        rows = has.nonzero().view(-1)
        target = win[rows, col[rows]]
        winner_rank = torch.full_like(flat, 2**62).scatter_reduce(
            0, target, rank[rows], reduce="amin", include_self=True
        )
        won = winner_rank[target] == rank[rows]
        w_rows, w_target = rows[won], target[won]
        previous = flat[w_target]
        evicted_parts.append(w_target[previous != -1])
        flat[w_target] = uniq[new[w_rows]]
        if md is not None:
            md[w_target] = meta[w_rows]
        slot[new[w_rows]] = w_target
        active[w_rows] = False
        lost = rows[~won]
        cursor[lost] = col[lost] + 1
        # Ids with nothing claimable left stop here.
    if lru and md is not None:
        # No empty slot on the path: take the evictable slot with the oldest metadata.
        while bool(active.any()):
            rows = active.nonzero().view(-1)
            score = md[win[rows]]
            ok = (eviction_threshold > score) & (score < meta[rows].unsqueeze(1))
            if not bool(ok.any()):
                break
            masked = torch.where(ok, score, torch.full_like(score, 2**31 - 1))
            has = ok.any(dim=1)
            col = masked.argmin(dim=1)  # first minimum: the earliest on the probe path
            rows, col = rows[has], col[has]
            target = win[rows, col]
            winner_rank = torch.full_like(flat, 2**62).scatter_reduce(
                0, target, rank[rows], reduce="amin", include_self=True
            )
            won = winner_rank[target] == rank[rows]
            w_rows, w_target = rows[won], target[won]
            evicted_parts.append(w_target)
            flat[w_target] = uniq[new[w_rows]]
            md[w_target] = meta[w_rows]
            slot[new[w_rows]] = w_target
            active[w_rows] = False
            if not bool(won.any()):
                break
    evicted: torch.Tensor | None = None
    if evicting:
        evicted = torch.cat(evicted_parts)
    return slot, evicted
