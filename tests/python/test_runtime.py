"""strata.Runtime from Python: round trips through every tier, zero copy into torch and numpy,
leases whose arrays outlive their with block, a random workload checked against numpy, threads,
and every exception raised by a real cause."""

import json
import threading

import numpy as np
import pytest
import strata
import torch
from conftest import BACKEND, host_array, pattern, small_config

T = strata.Tier
A = strata.Access


def test_round_trip_through_every_tier(rt):
    data = pattern(32 * 1024, 1)  # 128 KiB
    t = rt.create_tensor("w", shape=(128, 256), dtype="float32", home=T.NVME, init=data)
    assert (t.name, t.shape, t.dtype, t.nbytes) == ("w", (128, 256), "float32", data.nbytes)
    for tier in (T.HOST, T.DEVICE):
        with rt.acquire(t, tier) as lease:
            assert np.array_equal(host_array(lease).ravel(), data), tier
    # Written on the device, evicted (written back), read back from below.
    with rt.acquire(t, T.DEVICE, A.READ_WRITE) as lease:
        torch.from_dlpack(lease).mul_(3)
    assert rt.evict(t, T.DEVICE) is True
    assert not rt.resident(t, T.DEVICE)
    assert np.array_equal(rt.read(t).ravel(), data * 3)
    assert rt.evict(t, T.HOST) is True  # the host copy was the newest: written to NVMe
    assert np.array_equal(rt.read(t).ravel(), data * 3)
    stats = rt.stats()
    assert stats["transfers"]["bytes_device_to_host"] == data.nbytes
    assert stats["transfers"]["bytes_host_to_nvme"] == data.nbytes


def test_a_lease_is_zero_copy_into_torch_and_numpy(rt):
    t = rt.create_tensor("x", (64, 64), np.float32)
    for tier in (T.DEVICE, T.HOST):
        with rt.acquire(t, tier, A.READ_WRITE) as lease:
            x = torch.from_dlpack(lease)
            assert x.data_ptr() == lease.data_ptr
            assert x.shape == (64, 64) and x.dtype == torch.float32
            assert x.is_cuda == (BACKEND == "cuda" and tier == T.DEVICE)
            x.fill_(7.0)
            if x.is_cuda:  # numpy takes no CUDA memory; a second torch view shares the bytes
                with pytest.raises(BufferError):
                    np.from_dlpack(lease)
                assert torch.from_dlpack(lease)[3, 5].item() == 7.0
            else:
                a = np.from_dlpack(lease)
                assert a.ctypes.data == lease.data_ptr
                assert a[3, 5] == 7.0  # the same bytes
                del a
            del x


def test_every_dtype_spelling_and_bfloat16_round_trip(rt):
    for spelling in ("bfloat16", "bf16", "BF16", torch.bfloat16):
        assert rt.create_tensor("b", (4,), spelling).dtype == "bfloat16"
    assert rt.create_tensor("f", (2,), np.float64).dtype == "float64"
    assert rt.create_tensor("h", (2,), np.dtype("float16")).dtype == "float16"
    assert rt.create_tensor("i", (2,), "int64").dtype == "int64"
    src = torch.tensor([1.5, -2.0, 3.25, 1e4], dtype=torch.bfloat16)
    t = rt.create_tensor("w", (4,), torch.bfloat16, init=src)
    with rt.acquire(t, T.DEVICE) as lease:
        assert torch.equal(torch.from_dlpack(lease).cpu(), src)
    # read(): numpy has no bfloat16, so its bit patterns.
    assert np.array_equal(rt.read(t), src.view(torch.int16).numpy().view(np.uint16))
    with pytest.raises(strata.InvalidArgumentError, match="unknown dtype"):
        rt.create_tensor("z", (1,), "complex64")


def test_an_array_outliving_its_with_block_keeps_the_lease(rt):
    data = pattern(4096, 2)
    t = rt.create_tensor("w", (4096,), "float32", init=data)
    with rt.acquire(t, T.DEVICE) as lease:
        y = torch.from_dlpack(lease)
    assert not lease.active
    # The copy is still leased: not evictable, and its bytes are still the tensor's.
    with pytest.raises(strata.InvalidArgumentError, match="leased"):
        rt.evict(t, T.DEVICE)
    assert np.array_equal(y.cpu().numpy(), data)
    del y
    assert rt.evict(t, T.DEVICE) is False  # clean: dropped, nothing written
    assert not rt.resident(t, T.DEVICE)


def test_write_and_read_take_any_array(rt):
    t = rt.create_tensor("w", (8, 8), "float32")
    rt.write(t, torch.arange(64, dtype=torch.float32).reshape(8, 8).t())  # not contiguous
    assert np.array_equal(rt.read(t), np.arange(64, dtype=np.float32).reshape(8, 8).T)
    rt.write(t, np.ones(64, dtype=np.float32))
    assert rt.read(t).sum() == 64
    with pytest.raises(strata.InvalidArgumentError, match="write of 128 bytes"):
        rt.write(t, np.ones(32, dtype=np.float32))


def test_config_as_a_dict_a_json_string_or_a_file(tmp_path):
    config = small_config(tmp_path)
    path = tmp_path / "strata.json"
    path.write_text(json.dumps(config))
    for form in (config, json.dumps(config), path, str(path)):
        rt = strata.Runtime(form)
        assert rt.stats()["tiers"]["Device"]["capacity_bytes"] == 1 << 20


def test_a_random_workload_several_times_the_budgets_loses_no_byte(rt):
    # 48 tensors of 64 KiB: 3 MiB against 1 MiB of device and 2 MiB of pinned host.
    rng = np.random.default_rng(7)
    truth = [pattern(16 * 1024, 100 + i) for i in range(48)]
    tensors = [
        rt.create_tensor(f"t{i}", (16 * 1024,), "float32", home=T.NVME, init=truth[i])
        for i in range(48)
    ]
    for step in range(400):
        i = int(rng.integers(48))
        op = rng.integers(5)
        if op == 0:
            with rt.acquire(tensors[i], T.DEVICE, A.READ_WRITE) as lease:
                torch.from_dlpack(lease).add_(1.0)
            truth[i] = truth[i] + np.float32(1.0)
        elif op == 1:
            with rt.acquire(tensors[i], T.HOST) as lease:
                assert np.array_equal(np.from_dlpack(lease), truth[i]), (step, i)
        elif op == 2:
            rt.prefetch(tensors[i], T.DEVICE)
        elif op == 3:
            for tier in (T.DEVICE, T.HOST):
                if rt.resident(tensors[i], tier):
                    rt.evict(tensors[i], tier)
        else:
            assert np.array_equal(rt.read(tensors[i]), truth[i]), (step, i)
    rt.synchronize()
    for i in range(48):
        assert np.array_equal(rt.read(tensors[i]), truth[i]), i
    assert rt.stats()["tiers"]["Device"]["evictions"] > 0


def test_threads_acquire_and_release_at_once(rt):
    errors = []
    truth = {}

    def worker(k):
        try:
            t = rt.create_tensor(f"mine{k}", (8192,), "float32", init=pattern(8192, k))
            value = pattern(8192, k)
            for r in range(60):
                with rt.acquire(t, T.DEVICE, A.READ_WRITE) as lease:
                    x = torch.from_dlpack(lease)
                    if not np.array_equal(x.cpu().numpy(), value):
                        errors.append((k, r))
                    x.add_(1.0)
                    del x
                value = value + np.float32(1.0)
                if r % 5 == 0:
                    rt.evict(t, T.DEVICE)
            truth[k] = (t, value)
        except Exception as e:  # noqa: BLE001 (reported below, with the thread)
            errors.append((k, repr(e)))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
        assert not th.is_alive(), "deadlock: a thread did not finish"
    assert errors == []
    for t, value in truth.values():
        assert np.array_equal(rt.read(t), value)


def test_errors_from_real_causes(tmp_path):
    # A bad key: InvalidArgumentError, also a ValueError, naming the key.
    with pytest.raises(ValueError, match="nvme.pathz: unknown key"):
        strata.Runtime({"nvme": {"pathz": []}})
    # A tier too small: OutOfMemoryError with the numbers.
    rt = strata.Runtime(small_config(tmp_path))
    with pytest.raises(strata.OutOfMemoryError) as e:
        rt.create_tensor("huge", (1 << 20,), "float32", home=T.DEVICE)
    assert isinstance(e.value, MemoryError)
    assert e.value.requested_bytes == 4 << 20 and e.value.tier == "Device"
    # An unknown tensor id: NotFoundError, also a KeyError.
    with pytest.raises(KeyError, match="no tensor 999"):
        rt.tensor(999)


def test_an_injected_eio_is_an_ioerror_with_its_errno(tmp_path):
    rt = strata.Runtime(small_config(tmp_path, io={"faults": ["read:1:eio"]}))
    data = pattern(16 * 1024, 3)
    t = rt.create_tensor("w", (16 * 1024,), "float32", home=T.NVME, init=data)
    with pytest.raises(strata.IoError) as e:
        rt.acquire(t, T.HOST)
    assert e.value.errno == 5  # EIO
    assert isinstance(e.value, OSError)
    with rt.acquire(t, T.HOST) as lease:  # the next read works: nothing was lost
        assert np.array_equal(np.from_dlpack(lease), data)


def test_a_flipped_byte_in_a_swap_file_is_corrupt_data(tmp_path):
    rt = strata.Runtime(small_config(tmp_path, nvme={"keep_files": True}))
    t = rt.create_tensor("w", (16 * 1024,), "float32", home=T.NVME, init=pattern(16 * 1024, 4))
    swap = [p for p in tmp_path.iterdir() if p.is_file()]
    assert len(swap) == 1, swap
    with open(swap[0], "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(strata.CorruptDataError, match="checksum|CRC"):
        rt.read(t)


def test_a_safetensors_file_maps_in_place_and_a_malformed_one_is_refused(tmp_path):
    from safetensors.numpy import save_file

    tensors = {"a": pattern(1000, 5), "b": np.arange(12, dtype=np.int64).reshape(3, 4)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    (tmp_path / "nvme").mkdir()
    rt = strata.Runtime(small_config(tmp_path / "nvme"))
    mapped = strata.safetensors.map(rt, path)
    assert sorted(mapped) == ["a", "b"]
    assert mapped["b"].shape == (3, 4) and mapped["b"].dtype == "int64"
    for name, t in mapped.items():
        assert np.array_equal(rt.read(t), tensors[name]), name
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path.read_bytes()[:20])
    with pytest.raises(strata.CorruptDataError):
        strata.safetensors.map(rt, bad)


def test_the_docs_are_real():
    assert "tiered tensor offload" in strata.__doc__
    assert "dict, a JSON string" in strata.Runtime.__doc__
    assert "Blocks" in strata.Runtime.acquire.__doc__


def test_asking_for_cuda_without_a_gpu_is_unsupported_and_with_one_works():
    # The one place a skip would hide a failure: both outcomes are checked, by what the
    # machine has (torch's view of it).
    if torch.cuda.is_available():
        rt = strata.Runtime({"backend": "cuda", "device_budget": "64MiB", "quiet": True})
        t = rt.create_tensor("w", (1024,), "float32", init=np.ones(1024, np.float32))
        with rt.acquire(t, T.DEVICE) as lease:
            x = torch.from_dlpack(lease)
            assert x.is_cuda and x.data_ptr() == lease.data_ptr
            assert x.sum().item() == 1024
    else:
        with pytest.raises(strata.UnsupportedError, match="backend cuda: no CUDA device"):
            strata.Runtime({"backend": "cuda"})


def test_dlpack_stream_argument_follows_the_protocol(rt):
    # A CPU array's copy is waited for on the host, and a consumer's stream is refused with
    # BufferError, as DLPack asks (None and -1 are accepted). On the CUDA backend the host
    # tier's lease is that CPU array (kDLCUDAHost); the device tier's stream case is below.
    data = pattern(4096, 3)
    t = rt.create_tensor("s", (4096,), "float32", home=T.NVME, init=data)
    tier = T.HOST if BACKEND == "cuda" else T.DEVICE
    with rt.acquire(t, tier) as lease:
        assert lease.__dlpack_device__() == ((3, 0) if BACKEND == "cuda" else (1, 0))
        assert np.array_equal(np.from_dlpack(lease), data)
        capsule = lease.__dlpack__(stream=-1)
        assert type(capsule).__name__ == "PyCapsule"
        with pytest.raises(BufferError, match="stream must be None or -1, not 7"):
            lease.__dlpack__(stream=7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA backend)")
def test_a_cuda_lease_makes_the_consumers_stream_wait(tmp_path):
    # The device lease is handed out while its host->device copy may still run; torch passes
    # its current stream to __dlpack__, which waits on the copy's event without blocking the
    # host. Reading on that stream must see the bytes.
    rt = strata.Runtime(
        small_config(tmp_path, backend="cuda", device_budget="64MiB", host_budget="64MiB")
    )
    data = pattern(4 * 1024 * 1024, 4)
    t = rt.create_tensor("c", (data.size,), "float32", home=T.NVME, init=data)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), rt.acquire(t, T.DEVICE) as lease:
        assert lease.__dlpack_device__()[0] == 2  # kDLCUDA
        x = torch.from_dlpack(lease)
        assert x.data_ptr() == lease.data_ptr
        total = x.double().sum()
    torch.cuda.synchronize()
    assert total.item() == pytest.approx(float(data.astype(np.float64).sum()), rel=1e-12)
    with rt.acquire(t, T.DEVICE) as lease, pytest.raises(BufferError, match="ambiguous"):
        lease.__dlpack__(stream=0)
