"""Run by .ci/run's wheel stage with the Python of a fresh environment into which only the
wheel built by `pip install .` (and numpy) was installed: the package imports from there, its
binding works, a lease is zero copy into numpy, and the stubs and docs are in place."""

import os
import sys
import tempfile

import numpy as np
import strata

here = os.path.dirname(os.path.abspath(__file__))
package = os.path.dirname(strata.__file__)
assert "site-packages" in package, f"strata imported from {package}, not the installed wheel"
assert os.path.exists(os.path.join(package, "_core.pyi")), "the binding's stubs are missing"
assert os.path.exists(os.path.join(package, "py.typed"))
assert "dict, a JSON string" in (strata.Runtime.__doc__ or "")

with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
    rt = strata.Runtime(
        {
            "backend": "host",
            "device_budget": "4MiB",
            "host_budget": "8MiB",
            "nvme": {"paths": [d], "capacity": "64MiB"},
            "quiet": True,
        }
    )
    data = np.arange(65536, dtype=np.float32)
    t = rt.create_tensor("w", data.shape, "float32", home=strata.Tier.NVME, init=data)
    with rt.acquire(t, strata.Tier.DEVICE, strata.Access.READ_WRITE) as lease:
        a = np.from_dlpack(lease)
        assert a.ctypes.data == lease.data_ptr
        a *= 2
        del a
    rt.evict(t, strata.Tier.DEVICE)
    assert np.array_equal(rt.read(t), data * 2)
    try:
        strata.Runtime({"nvme": {"pathz": []}})
    except ValueError as e:
        assert "nvme.pathz" in str(e)
    else:
        sys.exit("a bad key was accepted")
print(f"installed strata OK from {package}")
