"""Named hardware barrier ids of the forward kernel (id 0 is `__syncthreads`)."""
from __future__ import annotations

import enum


class FwdBarrier(enum.IntEnum):
    EPILOGUE = 1  # consumer threads + the storing warp: O is in shared memory
    TURN_WG1 = 2  # ping-pong: consumer warpgroup 1 may issue its GEMMs
    TURN_WG2 = 3  # ping-pong: consumer warpgroup 2 may issue its GEMMs
    TURN_WG3 = 4  # (three consumer warpgroups: the turn passes round-robin)
