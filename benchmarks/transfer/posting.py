"""What `hybridkv bench transfer` posts through NIXL beside hybridkv's fetch, and what posting costs.

The raw span, whole or cut into ``--raw-splits`` descriptors (b); the descriptor list of the vLLM
0.33 scheme (c) with that scheme's per-request id build; ``_timed``, one such post timed from handle
creation to DONE (and its posting thread's CPU); ``posting_fit``, the per-descriptor and fixed cost
through two of them.
"""

from __future__ import annotations

import time


def parse_splits(text: str) -> tuple[int, ...]:
    """The raw span's descriptor counts from "1,2,8": 1 always first (it is the baseline)."""
    try:
        ns = [int(p) for p in text.split(",")]
    except ValueError:
        ns = []
    if not ns or any(n < 1 or n > 4096 for n in ns):
        raise ValueError(f"--raw-splits {text!r}; expected comma-separated descriptor counts from 1 to 4096")
    return tuple(dict.fromkeys([1, *ns]))


MAX_CURVE = 262_144


def parse_curve(text: str | None) -> tuple[int, ...]:
    """--posting-curve "1,64,1024": descriptor counts, each 1..MAX_CURVE, increasing."""
    if not text:
        return ()
    try:
        ns = [int(p) for p in text.split(",")]
    except ValueError:
        ns = []
    if not ns or any(n < 1 or n > MAX_CURVE for n in ns) or ns != sorted(set(ns)):
        raise ValueError(f"--posting-curve {text!r}; expected increasing comma-separated descriptor counts from 1 "
                         f"to {MAX_CURVE:,}")
    return tuple(ns)


def gapped_rows(base: int, nbytes: int, device: int, n: int, piece: int):
    """n descriptors of `piece` bytes spread evenly over [base, base + nbytes), none touching the next, so
    no layer of NIXL or UCX can merge them: what many small scattered pages (kernel blocks, head slices)
    cost to post and to land."""
    import numpy as np

    stride = nbytes // n
    if stride <= piece:
        raise ValueError(f"{n:,} descriptors of {piece} bytes do not fit apart in {nbytes:,} bytes; "
                         "lower --posting-curve's largest count or --probe-bytes")
    return np.array([[base + i * stride, piece, device] for i in range(n)], np.uint64)


def _span_rows(base: int, nbytes: int, device: int, n: int):
    """n descriptors covering [base, base + nbytes), equal but for the remainder on the last."""
    import numpy as np

    cut = nbytes // n
    rows = np.array([[base + i * cut, cut, device] for i in range(n)], np.uint64)
    rows[-1, 1] = nbytes - cut * (n - 1)
    return rows


def _vllm_scheme_rows(memory, layout, attn_region: int, gdn_region: int, n_attn: int, n_gdn: int, blocks: int):
    """(addr, len, dev) rows in vLLM 0.33 order: attention layer-major over blocks, then conv+ssm per GDN layer."""
    import numpy as np

    rows = []
    a = memory.regions[attn_region]
    piece = a.page_bytes // n_attn
    for layer in range(n_attn):
        for b in range(blocks):
            rows.append((a.base_addr + b * a.stride + layer * piece, piece, a.device_id))
    g = memory.regions[gdn_region]
    gpiece = g.page_bytes // (2 * n_gdn)
    for i in range(2 * n_gdn):
        rows.append((g.base_addr + i * gpiece, gpiece, g.device_id))
    # Same bytes as the page path: give the remainders to the last pieces.
    arr = np.array(rows, dtype=np.uint64)
    arr[n_attn * blocks - 1, 1] += a.page_bytes - piece * n_attn
    arr[-1, 1] += g.page_bytes - gpiece * 2 * n_gdn
    return arr


def _timed(agent, op: str, lh, li, rh, ri, notif: bytes = b"", build=None) -> tuple[float, int, float, float]:
    """(seconds from handle creation to DONE, descriptors NIXL posted, seconds to build, make and post,
    CPU seconds this thread spent building, making and posting).

    `build`, if given, makes the index arrays (li, ri are then ignored): an engine computes its
    descriptor ids per request, in the thread that posts, so that is part of what posting costs it.
    """
    # Timed from handle creation, as hybridkv's fetch is: an engine makes a handle per request too.
    c0 = time.thread_time()
    t0 = time.perf_counter()
    if build is not None:
        li, ri = build()
    h = agent.make_prepped_xfer(op, lh, li, rh, ri, notif)
    agent.transfer(h)
    posted_s = time.perf_counter() - t0
    posted_cpu = time.thread_time() - c0
    while (s := agent.check_xfer_state(h)) == "PROC":
        pass
    dt = time.perf_counter() - t0
    if s != "DONE":
        raise RuntimeError(f"baseline transfer ended {s}")
    desc = int(agent.get_xfer_telemetry(h).descCount)
    agent.release_xfer_handle(h)
    return dt, desc, posted_s, posted_cpu


def _vllm_ids(region_rows: int, blocks: "np.ndarray", tail: int):
    """Descriptor ids of one request the way vLLM 0.33's worker computes them per transfer
    (`_get_block_descs_ids`: region-major ids region * num_blocks + block, vectorised, then the
    GDN state rows): the per-request id work that rides with every post."""
    import numpy as np

    ids = (np.arange(region_rows, dtype=np.int64)[:, None] * len(blocks) + blocks[None, :]).ravel()
    first = region_rows * len(blocks)
    ids = np.concatenate([ids, np.arange(first, first + tail, dtype=np.int64)]).astype(np.int32)
    return ids, ids


def posting_fit(points: dict[str, tuple[int, float]]) -> tuple[float, float]:
    """(seconds per descriptor, fixed seconds) through the (descriptors, seconds) of the two most
    different descriptor counts: the slope between the one-span READ and the vLLM list."""
    (n0, t0), (n1, t1) = min(points.values()), max(points.values())
    if n1 == n0:
        raise ValueError(f"posting fit needs two descriptor counts, got {sorted(points.values())}")
    slope = (t1 - t0) / (n1 - n0)
    return slope, t0 - slope * n0
