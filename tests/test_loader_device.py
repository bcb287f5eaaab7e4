"""``Loader(device="cuda")`` where torch cannot use CUDA: one clear DeviceError naming the device, nothing left open."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from foresight.errors import DeviceError, ForesightError
from foresight.format import DatasetWriter, open_dataset
from foresight.loader import Loader
from foresight.plan import build_plan


@pytest.fixture
def plan_and_data(tmp_path):
    with DatasetWriter(str(tmp_path / "ds"), fsync=False) as w:
        for i in range(16):
            w.add(bytes([i]) * 100, modality="bytes")
    ds = open_dataset(str(tmp_path / "ds"))
    return build_plan([(ds, 1.0)], seed=0, global_batch_size=4, num_steps=2), ds


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine where torch has no CUDA")
def test_cuda_on_a_cpu_only_torch_is_one_clear_error(plan_and_data):
    plan, ds = plan_and_data
    threads = set(threading.enumerate())
    for device in ("cuda", "cuda:0"):
        with pytest.raises(DeviceError) as info:
            Loader(ds, plan, device=device)
        text = str(info.value)
        assert f"device='{device}'" in text and "device='cpu'" in text, text
        assert isinstance(info.value, ForesightError) and isinstance(info.value, RuntimeError)
    assert set(threading.enumerate()) <= threads  # refused before any thread or memory was set up


def test_a_cuda_device_this_machine_lacks_is_named(plan_and_data):
    plan, ds = plan_and_data
    with pytest.raises(DeviceError, match="cuda:99"):
        Loader(ds, plan, device="cuda:99")
    with Loader(ds, plan, device="cpu") as loader:
        assert [b.step for b in loader] == [0, 1]
