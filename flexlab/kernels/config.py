"""Static configuration of the Hopper forward kernel, and the one check that a configuration fits the chip.

Everything in `FwdConfig` is baked into the compiled kernel, so it is part of the compile-cache key. The tile shapes
per head dim (`default_config`) were measured on an H200 (bf16, H=16, dense; TFLOP/s; benchmarks/results/fwd_probe_*):

    D=128  128x128, 2 stages     B4·S4k 593-609   B1·S16k 633-645   B8·S1k 492-500   (default)
           128x128, 3 stages     B4·S4k 676 (one run)  B1·S16k 642   B8·S1k 473       (not adopted: re-measure)
           128x176, 2 stages     B1·S16k 635;  ping-pong off: B4·S4k 597, B1·S16k 645
    D=64   192x128, 3 stages     B4·S4k 463-496   B1·S16k 485-512                      (default, dense)
           192x128, 2 / 4 stg    B4·S4k 465 / 471-496;  128x128: 430;  ping-pong off: 444-449
"""
from __future__ import annotations

from dataclasses import dataclass

SMEM_BYTES_SM90 = 227 * 1024  # dynamic shared memory one CTA may use on H100/H200
REGISTERS_PER_SM = 64 * 1024
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class FwdConfig:
    """One forward-kernel shape: tiles, pipeline depth, and whether consumer warpgroups take turns (ping-pong).

    The softmax of block j always overlaps the PV GEMM of block j-1 inside a warpgroup (see fwd_sm90).

    `tile_m` rows of Q per CTA are split over `tile_m // 64` consumer warpgroups (one wgmma M=64 slab each); one more
    warpgroup is the TMA producer.
    """

    head_dim: int
    tile_m: int = 128
    tile_n: int = 128
    num_stages: int = 2
    pingpong: bool = True  # consumer warpgroups take turns on the tensor cores
    dtype_bytes: int = 2

    @property
    def num_consumer_wgs(self) -> int:
        return self.tile_m // 64

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_consumer_wgs + 1)

    @property
    def register_split(self) -> tuple[int, int]:
        """(producer, consumer) registers per thread after `setmaxnreg`; must sum to at most 64K per CTA."""
        return {1: (56, 256), 2: (24, 240), 3: (32, 160)}[self.num_consumer_wgs]

    def smem_bytes(self) -> int:
        """Bytes of the kernel's shared-storage struct: mbarriers first, then Q (reused for O), K and V rings, each
        buffer aligned to 1 KiB (the 128-byte swizzle repeats every 1 KiB)."""
        def up(n):
            return -(-n // 1024) * 1024
        barriers = 8 * (2 + 4 * self.num_stages)
        q = self.tile_m * self.head_dim * self.dtype_bytes
        kv = self.num_stages * self.tile_n * self.head_dim * self.dtype_bytes
        return up(barriers) + up(q) + 2 * up(kv)

    def feasibility_error(self) -> str | None:
        """Why this configuration cannot run on sm90, or None when it can."""
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim={self.head_dim} is not one of {SUPPORTED_HEAD_DIMS}"
        if self.tile_m not in (64, 128, 192):
            return f"tile_m={self.tile_m} must be 64, 128 or 192 (one to three 64-row consumer warpgroups)"
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            return f"tile_n={self.tile_n} must be a multiple of 16 in [16, 256] (wgmma N and K granularity)"
        if self.num_stages < 2:
            return f"num_stages={self.num_stages}: K/V need at least 2 stages to overlap loads with math"
        if self.pingpong and self.num_consumer_wgs < 2:
            return "pingpong scheduling needs at least two consumer warpgroups to alternate"
        if self.smem_bytes() > SMEM_BYTES_SM90:
            return f"needs {self.smem_bytes()} bytes of shared memory, sm90 has {SMEM_BYTES_SM90}"
        producer, consumer = self.register_split
        if 128 * producer + 128 * self.num_consumer_wgs * consumer > REGISTERS_PER_SM:
            return "register split exceeds 64K registers per CTA"
        # Per consumer thread: S accumulator (tile_n/2 fp32) + O accumulator (head_dim/2 fp32) + P (tile_n/4).
        live = self.tile_n // 2 + self.head_dim // 2 + self.tile_n // 4 + 24  # + indices, row stats, addresses
        if live > consumer:
            return f"about {live} live registers per consumer thread, only {consumer} after setmaxnreg"
        return None

    def validate(self) -> FwdConfig:
        err = self.feasibility_error()
        if err:
            raise ValueError(f"infeasible FwdConfig {self}: {err}")
        return self


def default_config(head_dim: int, block_sparse: bool = False, has_score_mod: bool = False) -> FwdConfig:
    """Tile shape per head dim.

    D=64 without a block mask or score_mod uses 192-row tiles (three consumer warpgroups); a block mask at torch's
    default 128 block size needs 128-row tiles, and a score_mod's extra registers spill at 160 per thread.
    """
    if head_dim <= 64:
        if not block_sparse and not has_score_mod:  # H200, B4 S4k: 496 TFLOP/s vs 465 with 2 stages, 430 at 128 rows
            return FwdConfig(head_dim=64, tile_m=192, tile_n=128, num_stages=3)
        return FwdConfig(head_dim=64, tile_m=128, tile_n=128, num_stages=2)
    if head_dim <= 128:  # H200, B1 S16k: 633 TFLOP/s; tile_n=176 gave 635 (noise); 3 stages do not fit in smem
        return FwdConfig(head_dim=128, tile_m=128, tile_n=128, num_stages=2)
    return FwdConfig(head_dim=256, tile_m=128, tile_n=64, num_stages=2)
