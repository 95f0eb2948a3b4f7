"""strata.torch.optim: Adam and AdamW with fp32 master weights and moments offloaded to the host
tier or NVMe, against torch.optim on the same model, data and steps; torch's checkpoint format
both ways; param groups and lr schedulers; bad input.

STRATA_TEST_BACKEND=cuda (bench/gpu-check.sh): the models and batches are CUDA tensors (the
states still live in the optimizer's own host-backend runtime, on the host tier or NVMe), and
torch's optimizer runs on the GPU."""

import copy

import pytest
import strata
import strata.torch as st
import torch
import transformers
from conftest import BACKEND

DEVICE = "cuda" if BACKEND == "cuda" else "cpu"


def _mlp(seed=0, width=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, 8),
    ).to(DEVICE)


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 32, generator=g).to(DEVICE), torch.randn(16, 8, generator=g).to(DEVICE))
        for _ in range(n)
    ]


def _train(model, opt, batches, sched=None):
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _max_rel(a, b):
    return max(
        (p - q).abs().max().item() / max(q.abs().max().item(), 1e-30)
        for p, q in zip(a.parameters(), b.parameters())
    )


# The tolerance: both run torch's Adam formula in fp32 from the same values; strata computes
# the step's constants in double and rounds once (Note [Adam step constants]) and orders a few
# operations differently (torch: lerp, addcdiv), so each step's result may differ by an ulp or
# two of the parameter, and 20 steps by at most 20 x 2 ulps: 40 x 2^-24 ~ 2.4e-6 of the largest
# parameter. Measured: well below (printed on failure).
STEPS = 20
TOL = STEPS * 2 * 2.0**-24


@pytest.mark.parametrize(
    "cls,theirs", [(st.optim.AdamW, torch.optim.AdamW), (st.optim.Adam, torch.optim.Adam)]
)
def test_twenty_steps_equal_torch_within_the_rounding_of_the_formula(cls, theirs, tmp_path):
    ours_model, ref_model = _mlp(), _mlp()
    kw = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
    ours = cls(ours_model.parameters(), offload="nvme", nvme_dir=tmp_path, **kw)
    ref = theirs(ref_model.parameters(), foreach=False, **kw)
    batches = _batches(STEPS)
    a, b = _train(ours_model, ours, batches), _train(ref_model, ref, batches)
    assert _max_rel(ours_model, ref_model) <= TOL, _max_rel(ours_model, ref_model)
    for la, lb in zip(a, b):
        assert la == pytest.approx(lb, rel=1e-5)


def test_clipping_and_accumulation_equal_torchs(tmp_path):
    # max_grad_norm clips as torch.nn.utils.clip_grad_norm_ does before AdamW; two backwards per
    # step accumulate in .grad as with torch.
    ours_model, ref_model = _mlp(), _mlp()
    ours = st.optim.AdamW(ours_model.parameters(), lr=1e-2, max_grad_norm=0.5)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    batches = _batches(2 * STEPS)
    norms = []
    for i in range(STEPS):
        for m in (ours_model, ref_model):
            for x, y in batches[2 * i : 2 * i + 2]:
                torch.nn.functional.mse_loss(m(x), y).backward()
        ours.step()
        norms.append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5).item())
        ref.step()
        for o in (ours, ref):
            o.zero_grad()
        assert ours.last_grad_norm == pytest.approx(norms[-1], rel=1e-5)
    assert max(norms) > 0.5  # the clipping did clip
    assert _max_rel(ours_model, ref_model) <= TOL, _max_rel(ours_model, ref_model)


def test_host_and_nvme_offload_give_the_same_bits(tmp_path):
    models = [_mlp(width=256), _mlp(width=256)]
    opts = [
        st.optim.AdamW(models[0].parameters(), lr=1e-2, offload="host"),
        st.optim.AdamW(
            models[1].parameters(), lr=1e-2, offload="nvme", nvme_dir=tmp_path, host_budget="800KiB"
        ),
    ]
    batches = _batches(10)
    for m, o in zip(models, opts):
        _train(m, o, batches)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    # The NVMe run's moments (616 KiB) did not all fit its host tier (572 KiB): they went back
    # and forth.
    stats = opts[1].runtime.stats()
    assert stats["transfers"]["bytes_host_to_nvme"] > 0
    assert stats["transfers"]["bytes_nvme_to_host"] > 0


def test_a_small_transformers_model_steps_as_torch_does(tmp_path):
    # A real model's trajectory is chaotic under Adam (a gradient near zero whose sign an ulp
    # flips moves its parameter by lr either way), so each step is compared from the same
    # start: torch's model and optimizer load strata's parameters and state (torch's
    # state_dict format, both ways), both take the step on the same batch, and the parameters
    # must agree within the step's rounding: the update (about lr) is a few fp32 operations,
    # each within half an ulp, and the subtraction from the parameter one more, so 4 x 2^-24
    # of (the largest value of the tensor + lr).
    config = transformers.GPT2Config(
        vocab_size=512,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    torch.manual_seed(0)
    ours_model = transformers.GPT2LMHeadModel(config).to(DEVICE)
    ref_model = copy.deepcopy(ours_model)
    ours = st.optim.AdamW(ours_model.parameters(), lr=1e-3, offload="nvme", nvme_dir=tmp_path)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        ref_model.load_state_dict(ours_model.state_dict())
        if step > 0:
            ref.load_state_dict(ours.state_dict())
        ids = torch.randint(0, 512, (2, 32), generator=g).to(DEVICE)
        losses = []
        for m, o in ((ours_model, ours), (ref_model, ref)):
            loss = m(ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]  # the same parameters: the same loss, bit for bit
        for (name, p), q in zip(ours_model.named_parameters(), ref_model.parameters()):
            bound = 4 * 2.0**-24 * (q.abs().max().item() + 1e-3)
            assert (p - q).abs().max().item() <= bound, (step, name)


def test_bf16_parameters_get_their_fp32_master_rounded():
    torch.manual_seed(0)
    model = _mlp().to(torch.bfloat16)
    opt = st.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batches(1)[0]
    torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
    opt.step()
    state = opt.state_dict()["state"]
    for i, p in enumerate(model.parameters()):
        assert p.dtype == torch.bfloat16
        # round to nearest even (on the GPU: the copy up rounds as the CPU does)
        assert torch.equal(p.cpu(), state[i]["master"].to(torch.bfloat16))
        assert state[i]["master"].dtype == torch.float32


def test_checkpoints_move_between_torch_and_strata_both_ways(tmp_path):
    batches = _batches(12)
    # torch for 6 steps, then strata from torch's state_dict for 6, against torch for 12.
    ref_model, mid_model = _mlp(), _mlp()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    mid = torch.optim.AdamW(mid_model.parameters(), lr=1e-2, foreach=False)
    _train(ref_model, ref, batches)
    _train(mid_model, mid, batches[:6])
    ours = st.optim.AdamW(mid_model.parameters(), lr=1e-2, offload="nvme", nvme_dir=tmp_path)
    ours.load_state_dict(mid.state_dict())
    _train(mid_model, ours, batches[6:])
    assert _max_rel(mid_model, ref_model) <= TOL
    # strata for 6 steps, then torch from strata's state_dict for 6.
    back_model = _mlp()
    ours = st.optim.AdamW(back_model.parameters(), lr=1e-2)
    _train(back_model, ours, batches[:6])
    theirs = torch.optim.AdamW(back_model.parameters(), lr=1e-2, foreach=False)
    theirs.load_state_dict(ours.state_dict())
    _train(back_model, theirs, batches[6:])
    assert _max_rel(back_model, ref_model) <= TOL
    assert ours.state_dict()["state"][0]["step"].item() == 6.0


def test_param_groups_and_an_lr_scheduler_work_as_with_torch():
    ours_model, ref_model = _mlp(), _mlp()

    def groups(m):
        return [
            {"params": list(m[0].parameters()), "lr": 1e-2, "weight_decay": 0.1},
            {
                "params": list(m[2].parameters())
                + list(m[3].parameters())
                + list(m[4].parameters()),
                "lr": 3e-3,
            },
        ]

    ours = st.optim.AdamW(groups(ours_model), lr=1e-3)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-3, foreach=False)
    s1 = torch.optim.lr_scheduler.StepLR(ours, step_size=3, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=3, gamma=0.5)
    batches = _batches(10)
    _train(ours_model, ours, batches, s1)
    _train(ref_model, ref, batches, s2)
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in ref.param_groups]
    assert _max_rel(ours_model, ref_model) <= 10 * 2 * 2.0**-24


def test_bad_input_is_a_clear_error(tmp_path):
    model = _mlp()
    with pytest.raises(strata.NotFoundError, match="nvme_dir '.*/missing': no such directory"):
        st.optim.AdamW(model.parameters(), offload="nvme", nvme_dir=tmp_path / "missing")
    with pytest.raises(strata.InvalidArgumentError, match='offload="nvme" needs nvme_dir'):
        st.optim.AdamW(model.parameters(), offload="nvme")
    with pytest.raises(
        strata.InvalidArgumentError, match='offload: \'disk\' is not "host" or "nvme"'
    ):
        st.optim.AdamW(model.parameters(), offload="disk")
    with pytest.raises(strata.OutOfMemoryError, match=r"sub_group_size 1000000: a piece's"):
        st.optim.AdamW(model.parameters(), host_budget="4MiB", sub_group_size=1_000_000)
    # offload="host" keeps every state in the host tier: too small a budget is refused up front
    # (it used to hang in the first step that needed a state that had not fitted).
    with pytest.raises(strata.OutOfMemoryError, match='offload="host": the optimizer states take'):
        st.optim.AdamW(torch.nn.Linear(512, 512).parameters(), offload="host", host_budget="1MiB")
    emb = torch.nn.Embedding(100, 8, sparse=True)
    opt = st.optim.AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(strata.InvalidArgumentError, match="a sparse gradient"):
        opt.step()


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_updates_during_backward_give_the_same_bits_as_updates_in_step(offload, tmp_path):
    # Note [Updates during backward]: with overlap each parameter is updated by the worker as
    # soon as backward has its gradient; the kernel sees the same values, so the parameters
    # equal those of updates in step() bit for bit, over accumulated micro-batches too.
    kw = {"lr": 1e-2, "offload": offload, "accumulation_steps": 2}
    if offload == "nvme":
        kw["nvme_dir"] = tmp_path
    models = [_mlp(width=128), _mlp(width=128)]
    opts = [
        st.optim.AdamW(models[0].parameters(), overlap=True, **kw),
        st.optim.AdamW(models[1].parameters(), overlap=False, **kw),
    ]
    batches = _batches(12)
    for m, o in zip(models, opts):
        for i in range(6):
            for x, y in batches[2 * i : 2 * i + 2]:
                torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    n = len(list(models[0].parameters()))
    assert opts[0].updates_during_backward == 6 * n  # every update ran during a backward
    assert opts[1].updates_during_backward == 0
    opts[0].close()
    m = models[0]
    torch.nn.functional.mse_loss(m(batches[0][0]), batches[0][1]).backward()
    before = [p.detach().clone() for p in m.parameters()]
    torch.nn.functional.mse_loss(m(batches[1][0]), batches[1][1]).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # closed: no hooks


def test_a_failed_update_during_backward_is_raised_by_step():
    model = _mlp()
    opt = st.optim.AdamW(model.parameters(), overlap=True)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt.add_param_group({"params": list(emb.parameters())})  # its hook registered too
    (emb(torch.tensor([1])).sum() + model(torch.randn(2, 32, device=DEVICE)).sum().cpu()).backward()
    with pytest.raises(strata.InvalidArgumentError, match="parameter 0 of group 1: a sparse"):
        opt.step()
    opt.zero_grad()
    model(torch.randn(2, 32, device=DEVICE)).sum().backward()
    opt.step()  # the failure was reported once; the optimizer goes on


def test_a_parameter_larger_than_the_host_budget_trains_in_pieces(tmp_path):
    # Note [Sub-groups]: a 512 x 512 weight has 2 MiB of moments; the host tier holds 320 KiB.
    # Its states stream NVMe -> host -> NVMe in pieces, and the result is the unsplit one's.
    def model():
        torch.manual_seed(5)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 8)
        ).to(DEVICE)

    small, big = model(), model()
    pieces = st.optim.AdamW(
        small.parameters(), lr=1e-2, offload="nvme", nvme_dir=tmp_path, host_budget="512KiB"
    )
    whole = st.optim.AdamW(big.parameters(), lr=1e-2, host_budget="64MiB")
    host = pieces.runtime.stats()["tiers"]["Host"]["capacity_bytes"]
    assert 8 * 512 * 512 > host
    assert 12 * pieces.sub_group_size <= host // 4  # a piece takes at most a quarter
    g = torch.Generator().manual_seed(9)
    for _ in range(4):
        x, y = torch.randn(8, 32, generator=g).to(DEVICE), torch.randn(8, 8, generator=g).to(DEVICE)
        for m, o in ((small, pieces), (big, whole)):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(small.parameters(), big.parameters()):
        assert torch.equal(p, q)
    stats = pieces.runtime.stats()
    assert stats["tiers"]["Host"]["peak_bytes"] <= host
    assert stats["transfers"]["bytes_host_to_nvme"] > 2 * 8 * 512 * 512  # written back each step
    # The checkpoint joins the pieces: torch's format, one tensor per parameter.
    state = pieces.state_dict()["state"][2]
    assert state["exp_avg"].shape == (512, 512)
    assert torch.equal(state["exp_avg"], whole.state_dict()["state"][2]["exp_avg"])


def _faulty_runtime(tmp_path, faults):
    # The optimizer's own runtime (host backend, states on NVMe), its host tier too small for
    # the states, with an injected I/O error (io.faults: the N-th read or write fails).
    return strata.Runtime(
        {
            "backend": "host",
            "device_budget": "4MiB",
            "host_budget": "800KiB",
            "host_copy_on_the_way": False,
            "io": {"faults": faults},
            "nvme": {"paths": [str(tmp_path)], "capacity": "64MiB", "stripe": "256KiB"},
            "quiet": True,
        }
    )


def _notes(e):
    return "\n".join([str(e)] + getattr(e, "__notes__", []))


@pytest.mark.parametrize(
    "fault,finished",
    [("read:30:eio", False), ("write:40:eio", True)],
    ids=["a-read-mid-step", "a-write-back"],
)
def test_a_failed_state_io_is_reported_and_the_step_finished_once(fault, finished, tmp_path):
    # Note [A failed step is finished, not repeated]. An EIO reading a state mid-step raises
    # strata.IoError saying how far the step got; zero_grad() refuses to drop the gradients
    # it needs, and step() again updates only the rest. An EIO writing a state back after
    # every update is reported as such: the state stays in host memory, nothing to redo. Either
    # way the parameters equal a run without the fault, bit for bit. (prefetch="none": every
    # read is the step's own, so the N-th read is the same one in every run.)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    models = [_mlp(width=256), _mlp(width=256)]
    opts = [
        st.optim.AdamW(
            m.parameters(), lr=1e-2, prefetch="none", runtime=_faulty_runtime(tmp_path / d, f)
        )
        for m, d, f in zip(models, "ab", ([], [fault]))
    ]
    batches = _batches(8)
    _train(models[0], opts[0], batches)
    failures = []
    m, o = models[1], opts[1]
    for x, y in batches:
        torch.nn.functional.mse_loss(m(x), y).backward()
        try:
            o.step()
        except strata.IoError as e:
            failures.append(_notes(e))
            if not finished:
                with pytest.raises(strata.InvalidArgumentError, match="needs these gradients"):
                    o.zero_grad()
                o.step()  # finishes it
        o.zero_grad()
    assert len(failures) == 1, failures
    if finished:
        assert "updated all 8 parameters" in failures[0] and "Nothing to redo" in failures[0]
    else:
        assert "of 8 parameters" in failures[0] and "Call step() again" in failures[0]
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    assert opts[1].state_dict()["state"][0]["step"].item() == 8.0


@pytest.mark.parametrize("first", ["_zero", "optim", "_runtimes", "_load", "_activations"])
def test_each_module_of_the_package_imports_first_in_a_fresh_interpreter(first):
    """No circle between strata.torch's modules (optim and _zero share in_pages from _runtimes):
    whichever a user or a tool imports first, it imports."""
    import subprocess
    import sys
    from pathlib import Path

    where = str(Path(strata.__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-c", f"import strata.torch.{first}"],
        env={"PYTHONPATH": where, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,  # the return code is asserted with the output
    )
    assert done.returncode == 0, done.stderr
