"""strata.torch.offload_activations: saved tensors leave for strata tensors during forward and
come back for backward; gradients are the same bits as without it.

STRATA_TEST_BACKEND=cuda (bench/gpu-check.sh): the runtimes are on the CUDA backend and the
models and inputs CUDA tensors, so a saved activation goes down from HBM and comes back through
a device-tier lease (DLPack, kDLCUDA)."""

import pytest
import strata
import strata.torch as st
import torch
import transformers
from conftest import BACKEND

DEVICE = "cuda" if BACKEND == "cuda" else "cpu"


def _grads(model, run):
    model.zero_grad()
    run().backward()
    return [p.grad.clone() for p in model.parameters()]


def _saved_bytes(model, run, min_bytes):
    """The bytes of the tensors autograd saves in run() that offload_activations promises to
    move (contiguous, at least min_bytes, not a parameter), counted by a hook of our own."""
    params = {p.data_ptr() for p in model.parameters()}
    sizes = []

    def pack(t):
        nbytes = t.numel() * t.element_size()
        if nbytes >= min_bytes and t.is_contiguous() and t.data_ptr() not in params:
            sizes.append(nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sizes


@pytest.mark.parametrize("tier", [strata.Tier.HOST, strata.Tier.NVME])
def test_gradients_are_the_same_bits_with_activations_offloaded(tier, tmp_path):
    rt = strata.Runtime(
        {
            "backend": BACKEND,
            "device_budget": "8MiB",
            "host_budget": "8MiB",
            "quiet": True,
            "nvme": {"paths": [str(tmp_path)], "capacity": "64MiB"},
        }
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 4),
    ).to(DEVICE)
    x = torch.randn(128, 64).to(DEVICE)

    def loss():
        return model(x).square().mean()

    plain = _grads(model, loss)
    # The input x (128 x 64 floats), the GELU's input, the second Linear's input, the Tanh's
    # output and the last Linear's input (128 x 256 floats each).
    sizes = _saved_bytes(model, loss, 16 * 1024)
    assert sorted(sizes) == [128 * 64 * 4] + [128 * 256 * 4] * 4, sizes
    total = sum(sizes)
    with st.offload_activations(rt, min_bytes="16KiB", tier=tier) as stats:
        out = loss()
    assert stats.offloaded == len(sizes) and stats.offloaded_bytes == total
    assert rt.stats()["tensors"] == stats.offloaded  # held in strata until backward
    # Where they are while backward has not run: every byte on `tier`, none on the other; the
    # NVMe copies written through the io engine (a saved activation is created there).
    rt.synchronize()
    held = rt.stats()
    on_nvme = tier == strata.Tier.NVME
    assert held["tiers"]["Nvme"]["used_bytes"] == (total if on_nvme else 0)
    assert held["tiers"]["Host"]["used_bytes"] == (0 if on_nvme else total)
    assert held["io"]["bytes_written"] == (total if on_nvme else 0)
    assert held["io"]["bytes_read"] == 0
    model.zero_grad()
    out.backward()
    offloaded = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b)
    # What came back: from NVMe, each byte read once (to the host, or straight to the device);
    # from the host tier, nothing read from NVMe. A CUDA activation comes back through the
    # device tier (its bytes arrive there once); a CPU one is leased where it is.
    rt.synchronize()
    back = rt.stats()
    moved = back["transfers"]
    assert back["io"]["bytes_read"] == (total if on_nvme else 0)
    assert moved["bytes_nvme_to_host"] + moved["bytes_nvme_to_device"] == (total if on_nvme else 0)
    assert moved["bytes_host_to_nvme"] == moved["bytes_device_to_nvme"] == 0
    assert back["io"]["bytes_written"] == held["io"]["bytes_written"]  # none written back
    if BACKEND == "cuda":
        assert back["tiers"]["Device"]["bytes_in"] == total
    else:
        assert back["tiers"]["Device"]["bytes_in"] == 0
        assert moved["bytes_host_to_device"] == 0
    del out
    assert rt.stats()["tensors"] == 0  # every saved activation destroyed with the graph
    assert stats.kept > 0  # the parameters and the small ones stayed


def test_a_transformers_model_backward_matches(tmp_path):
    rt = strata.Runtime(
        {
            "backend": BACKEND,
            "device_budget": "16MiB",
            "host_budget": "16MiB",
            "quiet": True,
            "nvme": {"paths": [str(tmp_path)], "capacity": "64MiB"},
        }
    )
    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(DEVICE)
    ids = torch.randint(0, 256, (2, 64)).to(DEVICE)
    plain = _grads(model, lambda: model(ids, labels=ids).loss)

    def offloaded():
        with st.offload_activations(rt, min_bytes=4096) as stats:
            loss = model(ids, labels=ids).loss
        assert stats.offloaded > 0
        return loss

    for a, b in zip(plain, _grads(model, offloaded)):
        assert torch.equal(a, b)
    assert rt.stats()["tensors"] == 0


def test_a_bad_tier_is_refused():
    rt = strata.Runtime(
        {"backend": "host", "device_budget": "1MiB", "host_budget": "1MiB", "quiet": True}
    )
    with (
        pytest.raises(strata.InvalidArgumentError, match="is not HOST or NVME"),
        st.offload_activations(rt, tier=strata.Tier.DEVICE),
    ):
        pass


def test_an_activation_larger_than_the_host_tier_stays(tmp_path):
    rt = strata.Runtime(
        {
            "backend": "host",
            "device_budget": "1MiB",
            "host_budget": "256KiB",
            "quiet": True,
            "nvme": {"paths": [str(tmp_path)], "capacity": "16MiB"},
        }
    )
    host = rt.stats()["tiers"]["Host"]["capacity_bytes"]
    x = torch.randn(host // 4 + 1024, requires_grad=True)  # more bytes than the host tier
    with st.offload_activations(rt, min_bytes=1024, tier=strata.Tier.NVME) as saved:
        y = (x.exp() * 2).sum()
    y.backward()
    assert saved.too_large >= 1 and saved.offloaded == 0
    assert torch.equal(x.grad, x.detach().exp() * 2)
