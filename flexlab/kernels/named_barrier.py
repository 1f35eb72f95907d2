"""Named hardware barrier ids of the forward and backward kernels (id 0 is `__syncthreads`)."""
from __future__ import annotations

import enum


class FwdBarrier(enum.IntEnum):
    EPILOGUE = 1  # consumer threads + the storing warp: O is in shared memory
    TURN_WG1 = 2  # ping-pong: consumer warpgroup 1 may issue its GEMMs
    TURN_WG2 = 3  # ping-pong: consumer warpgroup 2 may issue its GEMMs
    TURN_WG3 = 4  # (three consumer warpgroups: the turn passes round-robin)
    # Persistent kernels: "O is in shared memory" gets its own id. With one epilogue per CTA, EPILOGUE serves both
    # syncs; with one per tile, a warp racing into the next tile's first sync must not meet the storing warp's
    # still-open sync of this tile on the same barrier with a different thread count.
    O_STORED = 5
    SPLIT_TAIL = 6  # `FwdConfig.split_tail`: every consumer thread has published its part of a cut tile


class BwdBarrier(enum.IntEnum):
    DS_READY = 1  # both consumer warpgroups wrote their half of dS^T to shared memory
    EPILOGUE = 2  # all GEMMs that read sK/sV are done; dK/dV may overwrite them
    DQ_READY_WG1 = 3  # without the dQ warp: one warpgroup's dQ partial is in shared memory, ready for the TMA reduce
    DQ_READY_WG2 = 4
    # BwdConfig.dq_warp (default): a warpgroup hands its dQ partial to the dQ warp (FULL), gets the slab back (EMPTY)
    DQ_FULL_WG1 = 5
    DQ_FULL_WG2 = 6
    DQ_EMPTY_WG1 = 7
    DQ_EMPTY_WG2 = 8
