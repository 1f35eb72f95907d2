"""The two waits on a TMA pipeline's stages, shared by the forward and backward kernels.

`try_first` (`FwdConfig.try_wait_first`, `BwdConfig.try_wait_first`): one `mbarrier.try_wait` without a
suspend-time hint comes first, and only a stage still not ready enters the wait loop whose hint lets the hardware
put the warps to sleep (NANOSLEEP.SYNCS in the SASS). FA4's kernels wait that way in effect; the plain wait sleeps at
the first miss. Trace-time choice: without it the generated code is the plain wait, unchanged.
"""
from __future__ import annotations


def wait_full(pipe, state, try_first: bool) -> None:
    """A consumer's wait until the stage `state` points at has been filled."""
    if try_first:
        pipe.consumer_wait(state, pipe.consumer_try_wait(state))
    else:
        pipe.consumer_wait(state)


def acquire_empty(pipe, state, try_first: bool) -> None:
    """The producer's wait until the stage `state` points at is free again."""
    if try_first:
        pipe.producer_acquire(state, pipe.producer_try_acquire(state))
    else:
        pipe.producer_acquire(state)
