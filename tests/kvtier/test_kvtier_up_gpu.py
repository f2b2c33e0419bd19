"""`kvtier up --device cuda`: GPUs assigned per replica (TP groups, explicit sharing), checked on a CPU box.

The engine launch itself needs a GPU; what is checked here is the plan each replica is started with and
that a GPU request on a machine without enough GPUs is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.up import Stack

pytestmark = pytest.mark.unit


def test_tp_groups_are_disjoint(tmp_path: Path) -> None:
    slots = Stack(tmp_path, replicas=2, device="cuda", tensor_parallel_size=2).plan_gpus(gpus=4)
    assert [s.devices for s in slots] == [(0, 1), (2, 3)]
    assert slots[0].env()["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert slots[0].memory_utilization == slots[1].memory_utilization > 0.5


def test_two_replicas_on_one_gpu_only_when_asked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="need 2 GPUs, have 1"):
        Stack(tmp_path, replicas=2, device="cuda").plan_gpus(gpus=1)
    shared = Stack(tmp_path, replicas=2, device="cuda", share_gpus=True).plan_gpus(gpus=1)
    assert [s.devices for s in shared] == [(0,), (0,)]
    assert sum(s.memory_utilization for s in shared) <= 0.9  # two engines never ask for the whole GPU each


def test_cpu_replicas_get_no_gpu(tmp_path: Path) -> None:
    assert Stack(tmp_path, replicas=3, device="cpu").plan_gpus(gpus=8) == [None, None, None]
    with pytest.raises(ValueError, match="tensor-parallel"):
        Stack(tmp_path, tensor_parallel_size=0)


def test_cli_refuses_cuda_without_gpus(tmp_path: Path) -> None:
    from connector.config import gpu_count

    if gpu_count():
        pytest.skip("this machine has GPUs")
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "up", "--device", "cuda", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--device cuda" in r.stderr and "GPU" in r.stderr, r.stderr
    assert not (tmp_path / "up.json").exists()
