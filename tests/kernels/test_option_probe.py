"""The option probe's variant switch (CPU): `use("flipped")` must hand the launcher the flipped configuration, the
same object for the same configuration, and `use("launcher")` / `restore()` must put the launcher's own back. A
switch that replaced the wrong attribute once timed a kernel against itself for a day of probes."""
from __future__ import annotations

import pytest

pytest.importorskip("cutlass")


@pytest.mark.parametrize("forward,field", [(True, "lazy_rescale"), (False, "kind_loops")])
def test_switch_flips_what_the_launcher_runs(forward, field):
    from option_probe import Switch

    from flexlab.kernels import bwd_launch
    from flexlab.kernels.config import default_config
    from flexlab.runtime import launch as fwd_launch
    switch = Switch([field], forward)
    module, hook = (fwd_launch, "scheduled") if forward else (bwd_launch, "_config")
    own = getattr(module, hook)
    args = (default_config(128, True), "", 0) if forward else (64, False, False, 128)
    try:
        switch.use("flipped")
        assert getattr(module, hook) is not own
        first, again = getattr(module, hook)(*args), getattr(module, hook)(*args)
        assert getattr(first, field) != getattr(own(*args), field)
        assert first is again and switch.asked[0] == 2
        switch.use("launcher")
        assert getattr(module, hook) is own
        switch.use("flipped")
    finally:
        switch.restore()
    assert getattr(module, hook) is own


def test_knob_switch_sets_the_knob_and_drops_memoised_configurations():
    from option_probe import KnobSwitch

    from flexlab.kernels import config as policy
    from flexlab.runtime import launch
    from flexlab.runtime.compile import KernelMods
    own = policy.DYNAMIC_MAX_MEAN_KV_BLOCKS
    # (a score_mod: block masks without one run dynamic tiles at every length whatever this knob says)
    mods = KernelMods(score_mod=lambda *a: None, mask_mod=lambda *a: None, source_hash="alibi+causal")
    switch = KnobSwitch("DYNAMIC_MAX_MEAN_KV_BLOCKS", 1000, forward=True)
    try:
        switch.use("launcher")
        assert not launch.config_for(128, True, mods, 16384, num_sms=132, mean_kv_blocks=64.5).dynamic_tiles
        switch.use("flipped")  # long tiles now persistent with dynamic tiles, without a stale memo
        assert policy.DYNAMIC_MAX_MEAN_KV_BLOCKS == 1000
        assert launch.config_for(128, True, mods, 16384, num_sms=132, mean_kv_blocks=64.5).dynamic_tiles
        assert switch.configs() == []  # (no launch planned yet)
    finally:
        switch.restore()
        launch.forget_plans()
    assert policy.DYNAMIC_MAX_MEAN_KV_BLOCKS == own
    with pytest.raises(SystemExit, match="no knob"):
        KnobSwitch("NO_SUCH_KNOB", 1, forward=True)
