"""The one table that says which GPU architectures flexlab has kernels for, and how they are compiled.

Every other module asks here instead of comparing compute capabilities itself.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchEntry:
    name: str  # what `--gpu-arch` wants
    forward: bool  # a forward kernel exists
    description: str


ARCHES: dict[tuple[int, int], ArchEntry] = {
    (9, 0): ArchEntry("sm_90a", True, "Hopper (H100/H200): TMA + wgmma forward kernel"),
}


def arch_of(device) -> tuple[int, int]:
    import torch
    return torch.cuda.get_device_capability(device)


def forward_arch(capability: tuple[int, int]) -> ArchEntry | None:
    entry = ARCHES.get(tuple(capability))
    return entry if entry is not None and entry.forward else None


def supported_names() -> str:
    return ", ".join(f"sm_{a}{b} ({e.description})" for (a, b), e in ARCHES.items())
