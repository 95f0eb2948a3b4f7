"""Fixtures for the Python package's tests: a small runtime on the host backend with an NVMe
tier in a temporary directory (real files, io_uring, O_DIRECT where the filesystem allows).

STRATA_TEST_BACKEND=cuda runs the suite on the CUDA backend (bench/gpu-check.sh does), and
STRATA_REQUIRE_GPU=1 turns every skip into a failure: on a GPU machine nothing may skip."""

import os

import numpy as np
import pytest
import strata

BACKEND = os.environ.get("STRATA_TEST_BACKEND", "host")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("STRATA_REQUIRE_GPU") == "1":
        report.outcome = "failed"
        report.longrepr = f"skipped on a GPU machine (STRATA_REQUIRE_GPU=1): {report.longrepr}"


def small_config(tmp_path, **overrides):
    config = {
        "backend": BACKEND,
        "device_budget": "1MiB",
        "host_budget": "2MiB",
        "staging_chunk": "64KiB",
        "staging_chunks": 4,
        "io": {"block": "64KiB"},
        "nvme": {"paths": [str(tmp_path)], "capacity": "64MiB", "stripe": "64KiB"},
        "quiet": True,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


@pytest.fixture
def rt(tmp_path):
    return strata.Runtime(small_config(tmp_path))


def host_array(lease):
    """The lease's values as a numpy array: the lease itself (zero copy) where the host can read
    it, a copy of a CUDA device-tier lease (numpy takes no CUDA memory: it refuses kDLCUDA)."""
    if lease.__dlpack_device__()[0] == 2:  # kDLCUDA
        import torch

        return torch.from_dlpack(lease).cpu().numpy()
    return np.from_dlpack(lease)


def pattern(n, seed, dtype=np.float32):
    """n values of dtype, different for every seed (a fixed generator: reproducible)."""
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)
