"""tierkv.devices: a device name checked against this machine (issue #37, item 6)."""
from __future__ import annotations

import pytest
import torch

from tierkv.devices import resolve_device
from tierkv.errors import ConfigError, DeviceUnavailableError


def test_default_and_cpu():
    assert resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


def test_a_cuda_device_the_machine_lacks_is_a_typed_error_with_a_hint():
    bad = ["cuda", "cuda:0"] if not torch.cuda.is_available() else [f"cuda:{torch.cuda.device_count()}"]
    for name in bad:
        with pytest.raises(DeviceUnavailableError, match=f"device '{name}' is not available") as exc:
            resolve_device(name)
        assert "--device" in exc.value.hint


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: cuda:0 is accepted")
def test_an_existing_gpu_is_accepted():
    assert resolve_device("cuda:0") == "cuda:0"


def test_an_unknown_device_name():
    with pytest.raises(ConfigError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
