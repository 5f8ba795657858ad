"""The Warp device setting (`GRADSOLVE_WARP_DEVICE`) and the JAX-Warp bridge it picks:
what lets the suite pin Warp to the CPU on a machine with a GPU (tests/conftest.py)."""

import jax
import pytest

from gradsolve.warp import _jax, _runtime


SETTING = "GRADSOLVE_WARP_DEVICE"  # the public name (docs/internals.md)


@pytest.fixture
def fresh_device(monkeypatch):
    """`_runtime.device` read again under this test's settings, and again after it (it
    is cached per process)."""
    _runtime.device.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    _runtime.device.cache_clear()


def _sees_gpus(monkeypatch, count):
    monkeypatch.setattr(_runtime.warp(), "get_cuda_device_count", lambda: count)


def test_the_suite_pins_warp_to_the_cpu():
    # tests/conftest.py sets it, as it sets JAX_PLATFORMS: a GPU machine runs the
    # CPU router table and the FFI bridge here, tests/gpu the GPU side.
    assert _runtime.device() == "cpu"
    assert _jax.default_bridge() == "ffi"


def test_the_setting_pins_the_cpu_where_warp_sees_a_gpu(fresh_device):
    _sees_gpus(fresh_device, 1)
    fresh_device.delenv(SETTING, raising=False)
    assert _runtime.device() == "cuda"  # unset: the GPU when Warp sees one
    _runtime.device.cache_clear()
    fresh_device.setenv(SETTING, "cpu")
    assert _runtime.device() == "cpu"


def test_the_setting_refuses_a_device_that_is_not_there_or_not_known(fresh_device):
    _sees_gpus(fresh_device, 0)
    fresh_device.setenv(SETTING, "cuda")
    with pytest.raises(ValueError, match="GRADSOLVE_WARP_DEVICE=cuda, but Warp sees no CUDA"):
        _runtime.device()
    fresh_device.setenv(SETTING, "gpu")
    with pytest.raises(ValueError, match=r"GRADSOLVE_WARP_DEVICE must be 'cpu' or 'cuda'.*"
                                         r"got 'gpu'"):
        _runtime.device()


def test_jax_on_a_gpu_takes_the_callback_bridge_whatever_warps_device(fresh_device):
    # An FFI call from JAX on a GPU hands the host function device buffers, which it
    # does not take: Warp pinned to the CPU under JAX on a GPU must still use
    # jax.pure_callback.
    fresh_device.setenv(SETTING, "cpu")
    fresh_device.setattr(jax, "default_backend", lambda: "gpu")
    assert _jax.default_bridge() == "callback"
