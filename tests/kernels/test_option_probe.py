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
