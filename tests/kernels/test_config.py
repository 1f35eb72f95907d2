from __future__ import annotations

import pytest

from flexlab.kernels.config import FwdConfig, default_config


@pytest.mark.parametrize("D", [64, 128, 256])
def test_default_configs_are_feasible(D):
    assert default_config(D).feasibility_error() is None


def test_infeasible_configs_say_why():
    assert "shared memory" in FwdConfig(head_dim=256, tile_m=128, tile_n=256, num_stages=4).feasibility_error()
    assert "stages" in FwdConfig(head_dim=128, num_stages=1).feasibility_error()
    assert "head_dim" in FwdConfig(head_dim=96).feasibility_error()
    with pytest.raises(ValueError, match="pingpong"):
        FwdConfig(head_dim=64, tile_m=64).validate()
