"""strata.torch.optim with partition=True (ZeRO across ranks, Note [Shards] in
strata/torch/_zero.py): torchrun on CPU with gloo, 2 and 3 ranks, against single-process
torch.optim.AdamW over the same global batch; host vs NVMe bitwise; a checkpoint saved with 2
ranks resumed with 3; a rank whose state I/O fails makes every rank raise, naming it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import strata
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from zero_worker import GLOBAL_BATCH, batches, mlp

STEPS = 10
# Tolerance: each rank's gradient is the mean over its slice, and reduce_scatter averages the
# ranks' means: the same sum as one process's mean over the global batch in another order, so
# the gradients differ by a few ulps; Adam divides by sqrt(v), so a parameter's step differs by
# a few ulps of lr, and STEPS steps by STEPS x 4 ulps of the largest parameter.
TOL = STEPS * 4 * 2.0**-24


def torchrun(n, *args, timeout=240):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port on this machine
        "--nproc_per_node",
        str(n),
        str(HERE / "zero_worker.py"),
        *map(str, args),
    ]
    # The ranks import the strata this test imported (a build tree's or an installed one).
    where = str(Path(strata.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([where, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE, env=env, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]


def single_process(steps, first=0, start=None):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    if start is not None:
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optimizer"])
    for x, y in batches(first + steps)[first:]:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def max_rel(a, b):
    return max((p - q).abs().max().item() / q.abs().max().item() for p, q in zip(a, b))


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
    reason="needs a GPU and NCCL (the NCCL path runs in bench/gpu-check.sh)",
)
def test_nccl_on_one_gpu_trains_as_one_process_and_host_equals_nvme(tmp_path):
    # The GPU check: torchrun on NCCL with the model on the GPU, N = 1. The offloaded
    # states are the same either way (host, NVMe: bitwise); against single-process AdamW on the
    # CPU within 1e-4 relative (cuBLAS and the CPU's BLAS round the matmuls differently).
    for offload in ("host", "nvme"):
        torchrun(
            1, tmp_path / f"{offload}.pt", offload, STEPS, "--dist", "nccl", "--device", "cuda"
        )
    host, nvme = (torch.load(tmp_path / f"{o}.pt") for o in ("host", "nvme"))
    assert host["error"] is None, host["error"]
    assert all(torch.equal(p, q) for p, q in zip(host["params"], nvme["params"]))
    ref = single_process(STEPS)
    assert max_rel(host["params"], ref) <= 1e-4, max_rel(host["params"], ref)
    total = sum(p.numel() for p in mlp().parameters())
    assert host["offloaded"] == [total]


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_train_as_one_process_and_host_equals_nvme(n, tmp_path):
    for offload in ("host", "nvme"):
        torchrun(n, tmp_path / f"{offload}.pt", offload, STEPS)
    host, nvme = (torch.load(tmp_path / f"{o}.pt") for o in ("host", "nvme"))
    assert all(torch.equal(p, q) for p, q in zip(host["params"], nvme["params"]))
    assert host["losses"] == nvme["losses"]
    ref = single_process(STEPS)
    assert max_rel(host["params"], ref) <= TOL, max_rel(host["params"], ref)
    # Each rank holds 1/n of the states, within a bucket's padding (n - 1 elements each).
    total = sum(p.numel() for p in mlp().parameters())
    buckets = -(-total // 1000) + 4  # bucket_size 1000, cut at parameter boundaries
    for elements in host["offloaded"]:
        assert abs(elements - total / n) <= buckets * n, host["offloaded"]
    assert GLOBAL_BATCH % n == 0


def test_a_checkpoint_saved_with_two_ranks_resumes_with_three(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    torchrun(2, tmp_path / "first.pt", "host", 5, "--save", ckpt)
    torchrun(2, tmp_path / "two.pt", "host", 1, "--load", ckpt, "--first", 5)
    torchrun(3, tmp_path / "three.pt", "nvme", 1, "--load", ckpt, "--first", 5)
    two, three = (torch.load(tmp_path / f"{k}.pt")["params"] for k in ("two", "three"))
    # One step from the same state: within a step's rounding of the reordered gradient mean.
    assert max_rel(three, two) <= 4 * 2.0**-24 * 8, max_rel(three, two)
    # The gathered state is torch.optim.AdamW's: torch takes it and steps the same way.
    saved = torch.load(ckpt)
    assert saved["optimizer"]["state"][0]["step"].item() == 5.0
    ref = single_process(1, first=5, start=saved)
    assert max_rel(two, ref) <= 4 * 2.0**-24 * 8, max_rel(two, ref)


# One step from the same state and batch, strata's against torch.optim.AdamW's: strata's CPU
# Adam orders a few fp32 operations differently from torch's formula (test_torch_optim.py), so
# an element may differ by an ulp or two of (itself + lr); the gradients differ by a few ulps
# (the ranks' means averaged, against one mean over the global batch), which moves the update
# m / sqrt(v) by far less. Measured: at most 1.5 x 2^-24 (|q| + lr); the old gathered state
# (issue 29: the moments of the parameters wholly in other ranks' shards left out, so torch
# restarted them) missed by up to 1.8e-2.
def assert_one_step_apart(ours, theirs, lr=1e-2):
    for i, (p, q) in enumerate(zip(ours, theirs)):
        bound = 4 * 2.0**-24 * (q.abs() + lr)
        worst = ((p - q).abs() / bound).max().item()
        assert worst <= 1.0, f"parameter {i}: {worst} x the bound, {(p - q).abs().max().item()}"


def torch_resumes(ckpt, first):
    """torch.optim.AdamW over a fresh model, as a user resumes: model and optimizer loaded from
    `ckpt` (a torch.save of a state_dict(), each rank's the same), one step on batch `first`."""
    saved = torch.load(ckpt)
    return single_process(1, first=first, start=saved)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bucket_size", [1000, 1 << 22])
def test_torch_resumes_the_gathered_state_and_steps_as_strata_does(n, bucket_size, tmp_path):
    # Issue 29 item 8: 6 steps on NVMe, the state gathered, then strata's 7th step against
    # torch.optim.AdamW's from that state. With one bucket (the default size), rank r's shard
    # is a contiguous run of the reversed parameters: some lie wholly on other ranks.
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "out.pt"
    torchrun(n, out, "nvme", 7, "--save", ckpt, "--save-at", 6, "--bucket-size", bucket_size)
    saved, ours = torch.load(ckpt), torch.load(out)
    state = saved["optimizer"]["state"]
    params = list(mlp().parameters())
    assert sorted(state) == list(range(len(params)))
    for i, p in enumerate(params):
        assert state[i]["step"].item() == 6.0
        assert state[i]["exp_avg"].shape == p.shape and state[i]["exp_avg_sq"].shape == p.shape
        assert "master" not in state[i]  # fp32 parameters are their own master weights
    assert saved["optimizer"]["param_groups"][0]["params"] == list(range(len(params)))
    # A fresh model loading the checkpoint, and rank 0's deep copy of the trained model (which
    # carries none of the optimizer's gradient hooks), resume the same way.
    assert_one_step_apart(ours["params"], torch_resumes(ckpt, 6))
    assert_one_step_apart(ours["params"], ours["torch_next"])


@pytest.mark.parametrize("n", [2, 3])
def test_strata_resumes_torchs_state_and_steps_as_torch_does(n, tmp_path):
    # The other way: torch.optim.AdamW trains 6 steps, and strata's partitioned AdamW on n ranks
    # takes its state_dict() and steps as torch's 7th step.
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for x, y in batches(6):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "out.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
    torchrun(n, out, "nvme", 1, "--load", ckpt, "--first", 6, "--bucket-size", 1 << 22)
    assert_one_step_apart(torch.load(out)["params"], torch_resumes(ckpt, 6))


def test_a_rank_whose_state_io_fails_makes_every_rank_raise_naming_it(tmp_path):
    torchrun(2, tmp_path / "out.pt", "nvme", 4, "--fail-rank", 1, "--width", 256)
    out = torch.load(tmp_path / "out.pt")
    assert out["error"] is not None and "rank 1 of 2 failed its optimizer step" in out["error"]
    assert "IoError" in out["error"] and "Input/output error" in out["error"]


def test_a_rank_that_hangs_makes_the_others_raise_after_the_timeout_set(tmp_path):
    out = tmp_path / "out"
    # 30 s is many times any wait of a healthy run (steps of milliseconds, the ranks in step), so
    # only the hang can trip it; rank 1 hangs until rank 0 has reported, not for a fixed time.
    torchrun(2, out, "host", 3, "--hang-rank", 1, "--timeout", 30)
    reports = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    # Rank 0 waited in the first collective of step 2 for the process group's 30 s, then raised
    # naming it; rank 1, back from its stop, found its peer gone and raised too.
    for r, report in enumerate(reports):
        assert report["steps"] == 1, report
        error = report["error"]
        assert error is not None and f"rank {r} of 2: the reduce-scatter of bucket" in error
        assert "init_process_group(timeout=...)" in error
