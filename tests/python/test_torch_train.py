"""strata.torch.train: models trained with parameters, gradients, optimizer states and
activations under one pair of budgets, against the same model trained fully in memory.

References: torch.optim.AdamW in memory (within the rounding of the formula, as
test_torch_optim.py bounds it) and strata.torch.optim.AdamW in memory, whose kernel is checked
against a scalar reference in tests/runtime: equal to it bit for bit shows that streaming the
blocks, their gradients and their states changes no bit. Models are built offline from configs
(Llama; GPT-2 with its head tied to the embedding; nn.Sequential; a frozen base with adapters)."""

import os

import pytest
import strata
import strata.torch as st
import torch
import transformers
from conftest import BACKEND
from torch import nn

DEVICE = "cuda" if BACKEND == "cuda" else "cpu"
KW = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
STEPS = 3


def _llama(**over):
    kw = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    config = transformers.LlamaConfig(**{**kw, **over})
    torch.manual_seed(7)
    return transformers.LlamaForCausalLM(config)


def _gpt2(dropout=0.0):
    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=64,
        n_layer=4,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    torch.manual_seed(7)
    return transformers.GPT2LMHeadModel(config)


def _sequential():
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
    )


class _Adapted(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (LoRA's shape)."""

    def __init__(self, base, rank=4):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _adapted_llama():
    model = _llama(num_hidden_layers=6)
    model.requires_grad_(False)
    torch.manual_seed(8)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _Adapted(layer.self_attn.q_proj)
        layer.self_attn.v_proj = _Adapted(layer.self_attn.v_proj)
    return model


MODELS = {"llama": _llama, "gpt2": _gpt2, "sequential": _sequential, "adapted": _adapted_llama}
# Device budgets: the largest block fits, the whole training state is at least 4 times more.
BUDGETS = {"llama": "256KiB", "gpt2": "256KiB", "sequential": "32KiB", "adapted": "256KiB"}


def _batches(kind, n, seed=11):
    g = torch.Generator().manual_seed(seed)
    if kind == "sequential":
        return [
            (torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)
        ]
    return [torch.randint(0, 256, (2, 24), generator=g) for _ in range(n)]


def _loss(kind, model, batch):
    if kind == "sequential":
        x, y = batch
        return nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE))
    ids = batch.to(DEVICE)
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _train(kind, model, opt, batches, accumulate=1, clip=None):
    losses = []
    for i in range(0, len(batches), accumulate):
        for batch in batches[i : i + accumulate]:
            loss = _loss(kind, model, batch)
            loss.backward()
            losses.append(loss.item())
        if clip is not None:  # torch's model only: strata's optimizer clips itself
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses


def _named(model):
    """Each parameter once (a tied one under its first name), on the CPU."""
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _state_bytes(model):
    """Parameters (working copies), gradients, fp32 masters and both moments, in bytes."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if p.requires_grad:
            total += p.numel() * (p.element_size() + 12)
    return total


def _offload(model, tmp_path=None, **kw):
    budgets = {"device_budget": "256KiB", "host_budget": "16MiB"}
    budgets.update(kw)
    return st.train.offload(model, device=DEVICE, **KW, **budgets)


def _max_rel(ours, ref):
    return max(
        (ours[n] - q).abs().max().item() / max(q.abs().max().item(), 1e-30) for n, q in ref.items()
    )


@pytest.mark.parametrize("kind", list(MODELS))
def test_trains_as_adamw_in_memory_with_the_budget_a_fraction_of_the_state(kind):
    ref_torch = MODELS[kind]().to(DEVICE)
    ref_strata = MODELS[kind]().to(DEVICE)
    model = MODELS[kind]()
    state = _state_bytes(model)
    batches = _batches(kind, STEPS)
    model, opt = _offload(model, device_budget=BUDGETS[kind])
    torch_opt = torch.optim.AdamW(
        [p for p in ref_torch.parameters() if p.requires_grad], foreach=False, **KW
    )
    strata_opt = st.optim.AdamW([p for p in ref_strata.parameters() if p.requires_grad], **KW)
    # One step against torch: within a few ulps, the rounding of the formula (later steps' gradients carry
    # that rounding through the network, which amplifies it: the losses stay alike).
    assert _train(kind, model, opt, batches[:1]) == _train(kind, ref_torch, torch_opt, batches[:1])
    assert _max_rel(st.train.parameters(model), _named(ref_torch)) <= 4 * 2.0**-24
    ours = _train(kind, model, opt, batches[1:])
    assert ours == pytest.approx(_train(kind, ref_torch, torch_opt, batches[1:]), rel=1e-4)
    # Every step against strata's AdamW in memory: streaming changes no bit.
    assert ours == _train(kind, ref_strata, strata_opt, batches)[1:]
    got = st.train.parameters(model)
    want = _named(ref_strata)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    stats = opt.stats()
    # The budget held while the training state is many times it.
    assert state >= 4 * stats["device_budget"], (state, stats["device_budget"])
    assert 0 < stats["peak_device_bytes"] <= stats["device_budget"]
    assert stats["peak_host_bytes"] <= stats["host_budget"]
    assert stats["steps"] == STEPS
    # Every trainable parameter was updated during backward, once a step.
    trainable = len(opt._train)
    assert stats["updates_during_backward"] == STEPS * trainable
    # Backward's leases came from the recorded iteration: after the first, nothing on demand.
    assert stats["pipeline"]["divergences"] == 0
    if kind == "adapted":  # the frozen base: no state, never written
        frozen = {n for n, p in MODELS[kind]().named_parameters() if not p.requires_grad}
        assert {p.name for p in opt._train}.isdisjoint(frozen)
        base = _named(MODELS[kind]())
        for n in frozen:
            assert torch.equal(got[n], base[n]), n


def test_a_tied_head_is_one_tensor_saved_once():
    model, _opt = _offload(_gpt2())
    names = [p.names for p in model._strata_trainer.params if len(p.names) > 1]
    assert names == [["transformer.wte.weight", "lm_head.weight"]]
    assert "lm_head.weight" not in st.train.parameters(model)


def test_the_nvme_home_gives_the_host_homes_bits_and_reads_back_from_nvme(tmp_path):
    batches = _batches("llama", STEPS)
    host, host_opt = _offload(_llama())
    nvme, nvme_opt = _offload(_llama(), nvme_dir=tmp_path, host_budget="1MiB")
    _train("llama", host, host_opt, batches)
    _train("llama", nvme, nvme_opt, batches)
    a, b = st.train.parameters(host), st.train.parameters(nvme)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    stats = nvme_opt.stats()
    # With a host tier of 1 MiB, each step read the fp32 master and moments back from NVMe and
    # wrote them there (12 bytes an element each way, at least), and the working copies.
    trainable = sum(p.numel() for p in _llama().parameters())
    assert stats["nvme_bytes_read"] >= STEPS * 12 * trainable
    assert stats["nvme_bytes_written"] >= STEPS * 12 * trainable
    assert stats["peak_host_bytes"] <= stats["host_budget"]


def test_checkpointed_activations_are_the_same_bits_with_dropout():
    # Dropout on: the recompute must draw the forward's random numbers again, so the runs
    # with and without checkpointing (and torch in memory) agree bit for bit.
    batches = _batches("gpt2", STEPS)
    runs = []
    for checkpoint in (False, True):
        model, opt = _offload(_gpt2(dropout=0.1), checkpoint_activations=checkpoint)
        model.train()
        torch.manual_seed(99)
        losses = _train("gpt2", model, opt, batches)
        runs.append((losses, st.train.parameters(model)))
    ref = _gpt2(dropout=0.1).to(DEVICE)
    ref.train()
    torch.manual_seed(99)
    ref_losses = _train("gpt2", ref, st.optim.AdamW(ref.parameters(), **KW), batches)
    for losses, params in runs:
        assert losses == ref_losses
        for name, value in _named(ref).items():
            assert torch.equal(params[name], value), name


@pytest.mark.parametrize("checkpoint", [False, True])
def test_offloaded_activations_are_the_same_bits_and_leave_for_the_host_tier(checkpoint):
    # Dropout on and every saved tensor of a byte or more offloaded: what backward kept comes
    # back exactly, so the run is strata's AdamW in memory bit for bit.
    batches = _batches("gpt2", STEPS)
    model, opt = _offload(
        _gpt2(dropout=0.1), checkpoint_activations=checkpoint, offload_activations=1
    )
    model.train()
    rt = model._strata_trainer.runtime
    tensors = rt.stats()["tensors"]
    torch.manual_seed(5)
    losses = _train("gpt2", model, opt, batches)
    ref = _gpt2(dropout=0.1).to(DEVICE)
    ref.train()
    torch.manual_seed(5)
    assert losses == _train("gpt2", ref, st.optim.AdamW(ref.parameters(), **KW), batches)
    got = st.train.parameters(model)
    for name, value in _named(ref).items():
        assert torch.equal(got[name], value), name
    stats = opt.stats()
    acts = stats["activations"]
    assert acts["offloaded"] > 0 and acts["offloaded_bytes"] > 0, acts
    if checkpoint:  # a block's inputs (hidden states, contiguous) are all it keeps: all moved
        assert acts["kept"] == 0, acts
        hidden = 2 * 24 * model.config.n_embd * 4  # one batch's hidden states, fp32
        assert acts["offloaded_bytes"] % hidden == 0, acts
    assert stats["peak_host_bytes"] <= stats["host_budget"]
    assert rt.stats()["tensors"] == tensors  # each offloaded activation went with its graph


def test_clipping_and_accumulation_equal_torchs():
    batches = _batches("llama", 2 * STEPS)
    model, opt = _offload(_llama(), max_grad_norm=0.5, accumulation_steps=2)
    ref = _llama()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **KW)
    ours = _train("llama", model, opt, batches, accumulate=2)
    theirs = []
    norms = []
    for i in range(0, len(batches), 2):
        for batch in batches[i : i + 2]:
            loss = _loss("llama", ref, batch)
            loss.backward()
            theirs.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        ref_opt.step()
        ref_opt.zero_grad()
    assert norms[-1] > 0.5  # clipping applied
    assert opt.last_grad_norm == pytest.approx(norms[-1], rel=1e-5)
    assert _max_rel(st.train.parameters(model), _named(ref)) <= 1e-4  # rounding, amplified
    assert ours == pytest.approx(theirs, rel=1e-4)
    assert opt.stats()["updates_during_backward"] == 0  # clipping waits for the global norm


def test_a_scheduler_drives_the_learning_rate():
    batches = _batches("sequential", STEPS)
    model, opt = _offload(_sequential())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref = _sequential()
    ref_opt = st.optim.AdamW(ref.parameters(), **KW)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for batch in batches:
        for m, o, s in ((model, opt, sched), (ref, ref_opt, ref_sched)):
            _loss("sequential", m, batch).backward()
            o.step()
            o.zero_grad()
            s.step()
    assert opt.param_groups[0]["lr"] == KW["lr"] * 0.5**STEPS
    for name, value in _named(ref).items():
        assert torch.equal(st.train.parameters(model)[name], value), name


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_resuming_from_a_checkpoint_gives_the_bits_of_a_run_that_never_stopped(tmp_path, home):
    batches = _batches("llama", 4)
    kw = {"nvme_dir": tmp_path / "swap", "host_budget": "2MiB"} if home == "nvme" else {}
    if home == "nvme":
        (tmp_path / "swap").mkdir()
    model, opt = _offload(_llama(), **kw)
    _train("llama", model, opt, batches[:2])
    st.train.save_checkpoint(tmp_path / "ckpt", model, opt, shard_bytes=200_000)
    _train("llama", model, opt, batches[2:])
    unbroken = st.train.parameters(model)
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    # Hugging Face loads the checkpoint's parameters.
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
    resumed_model, resumed_opt = _offload(_llama(), **kw)
    st.train.load_checkpoint(tmp_path / "ckpt", resumed_model, resumed_opt)
    at_save = st.train.parameters(resumed_model)
    for name, value in _named(loaded).items():
        assert torch.equal(at_save[name], value), name
    _train("llama", resumed_model, resumed_opt, batches[2:])
    resumed = st.train.parameters(resumed_model)
    for name in unbroken:
        assert torch.equal(resumed[name], unbroken[name]), name
    assert resumed_opt.stats()["steps"] == 4


def test_a_checkpoint_directory_trains_as_its_model(tmp_path):
    _llama().save_pretrained(tmp_path / "hf")
    batches = _batches("llama", 2)
    model, opt = st.train.offload(
        os.fspath(tmp_path / "hf"), device=DEVICE, device_budget="256KiB", host_budget="16MiB", **KW
    )
    ref, ref_opt = _offload(_llama())
    assert _train("llama", model, opt, batches) == _train("llama", ref, ref_opt, batches)
    a, b = st.train.parameters(model), st.train.parameters(ref)
    for name in b:
        assert torch.equal(a[name], b[name]), name


def test_optimizer_state_dict_is_torchs_format():
    model, opt = _offload(_sequential())
    _train("sequential", model, opt, _batches("sequential", 2))
    sd = opt.state_dict()
    ref = _sequential()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **KW)
    _train("sequential", ref, ref_opt, _batches("sequential", 2))
    theirs = ref_opt.state_dict()
    assert sd["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        assert sd["state"][i].keys() == s.keys()
        assert float(sd["state"][i]["step"]) == float(s["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][i][k], s[k], rtol=1e-5, atol=1e-8)
    # torch.optim.AdamW resumes it.
    ref_opt.load_state_dict({k: v for k, v in sd.items() if k != "strata_master"})


# -- bad input: an error naming what, nothing lost --


def test_a_block_larger_than_the_device_budget_is_named():
    with pytest.raises(
        strata.OutOfMemoryError,
        match=r"block 'model.embed_tokens': its parameters take 65536 bytes and the device tier holds 32768",
    ):
        _offload(_llama(), device_budget="32KiB")


def test_a_missing_nvme_dir_is_named(tmp_path):
    with pytest.raises(strata.NotFoundError, match="nvme_dir .*nope.*: no such directory"):
        _offload(_sequential(), nvme_dir=tmp_path / "nope")


def test_host_budget_too_small_for_a_host_home_is_named():
    with pytest.raises(strata.OutOfMemoryError, match="do not fit the host tier .* pass nvme_dir"):
        _offload(_llama(), host_budget="1MiB")


def test_a_checkpoint_of_another_model_names_the_first_mismatched_tensor(tmp_path):
    model, opt = _offload(_llama())
    _train("llama", model, opt, _batches("llama", 1))
    st.train.save_checkpoint(tmp_path, model, opt)
    other, other_opt = _offload(_llama(intermediate_size=96))
    before = st.train.parameters(other)
    with pytest.raises(
        strata.InvalidArgumentError,
        match=r"tensor 'model.layers.0.mlp.gate_proj.weight' is \[128, 64\]",
    ):
        st.train.load_checkpoint(tmp_path, other, other_opt)
    after = st.train.parameters(other)
    for name in before:  # nothing changed
        assert torch.equal(before[name], after[name]), name


def test_a_sparse_gradient_is_named():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    model, _opt = _offload(model)
    loss = model(torch.tensor([1, 2])).sum()
    with pytest.raises(
        strata.InvalidArgumentError, match="parameter '0.weight': a sparse gradient"
    ):
        loss.backward()


def _faulty_runtime(nvme, faults):
    return strata.Runtime(
        {
            "backend": BACKEND,
            "device_budget": "256KiB",
            "host_budget": "1MiB",  # the states and working copies come and go from NVMe
            "nvme": {"paths": [str(nvme)], "capacity": "64MiB", "stripe": "256KiB"},
            "io": {"faults": faults},
            "quiet": True,
        }
    )


@pytest.mark.parametrize(
    "fault,positions,burst,clip",
    [
        ("read:{}:eio", [1, 28, 46, 64, 100, 136], 1, None),
        # A disk full for a while: the write-behind's demotions fail and keep their pieces,
        # and the room a step's lease needs meets the fault itself (Note [Write-behind]).
        ("write:{}:enospc", [4, 20, 40, 60, 80], 8, None),
        ("read:{}:eio", [28, 64, 100, 136], 1, 0.5),  # updates in step(), after the global norm
    ],
)
def test_an_io_error_in_a_step_is_raised_and_step_again_finishes_it(
    tmp_path, fault, positions, burst, clip
):
    # Each run fails one NVMe operation (the Nth read or write after the model is in place:
    # in a forward or backward, a lease tried again; in the worker's accumulation or update,
    # raised by step() naming the parameter). The user's protocol: step() again after a step
    # that raised. The result is the fault-free run's, bit for bit.
    batches = _batches("llama", 2)
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    rt = _faulty_runtime(clean_dir, [])
    kw = {"home": "nvme", "prefetch": "none", "max_grad_norm": clip, **KW}
    model, opt = st.train.offload(_llama(), runtime=rt, **kw)
    # The fault counts from the end of offload(): its writes (the tensors' first) come first.
    base = rt.stats()["io"]["operations"] if fault.startswith("write") else 0
    _train("llama", model, opt, batches)
    want = st.train.parameters(model)
    opt.close()
    raised, absorbed, fired = [], [], []
    for n in positions:
        nvme = tmp_path / f"f{n}"
        nvme.mkdir()
        rt = _faulty_runtime(nvme, [fault.format(base + n + i) for i in range(burst)])
        model, opt = st.train.offload(_llama(), runtime=rt, **kw)
        for batch in batches:
            _loss("llama", model, batch).backward()
            for attempt in range(burst + 1):  # till the disk has room again
                try:
                    opt.step()
                    break
                except strata.IoError as e:
                    assert "parameter '" in str(e), e
                    assert "step() again finishes it" in str(e), e
                    raised.append(n)
            else:
                raise AssertionError(f"fault {n}: step() again did not finish the step")
            opt.zero_grad()
        try:
            got = st.train.parameters(model)
        except strata.IoError:  # the worker's timing put the fault after training, here
            got = st.train.parameters(model)
        for name in want:
            assert torch.equal(got[name], want[name]), (n, name)
        # The fault happened (where is the threads' timing: a step raised it, a lease or a
        # prefetch hint tried again, the write-behind kept its piece) and cost nothing.
        if rt.stats()["io"]["failed_requests"]:
            fired.append(n)
        if opt.stats()["write_behind_failures"]:  # Note [Write-behind]: kept, written later
            absorbed.append(n)
        opt.close()
    # The hints' reads vary with timing: the last position may fall after a run's last read.
    assert fired[: len(positions) - 1] == positions[:-1], fired
    if fault.startswith("write"):  # eight writes in a row fail: demotions, and a step's room
        assert raised, "no fault landed in a step: the positions miss the updates"
        assert absorbed, "no write fault landed in the write-behind"


def _bf16_llama():
    model = _llama()
    for p in model.parameters():  # the parameters only: the buffers keep their dtype
        p.data = p.data.to(torch.bfloat16)
    return model


def test_a_bf16_model_keeps_fp32_masters_as_strata_adamw_in_memory_does():
    # The working copies are bf16; the fp32 masters and moments are the update's, and the
    # working copies are the masters rounded (the kernel's param_copy), as in memory.
    batches = _batches("llama", STEPS)
    model, opt = _offload(_bf16_llama())
    ref = _bf16_llama()
    ref_opt = st.optim.AdamW(ref.parameters(), **KW)
    assert _train("llama", model, opt, batches) == _train("llama", ref, ref_opt, batches)
    got = st.train.parameters(model)
    for name, value in _named(ref).items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], value), name
    masters = opt.state_dict()["strata_master"]
    assert all(m.dtype == torch.float32 for m in masters.values())
    for i, p in enumerate(opt._train):  # the working copy is its master rounded
        assert torch.equal(masters[i].to(torch.bfloat16), got[p.name]), p.name


def test_dtype_casts_the_working_copies_and_keeps_the_fp32_values_as_masters(tmp_path):
    # An fp32 model with dtype=bfloat16: the model computes in bf16, its masters start from the
    # fp32 values it had (not from their rounding), as mixed-precision training keeps them.
    fp32 = _named(_llama())
    model, opt = _offload(_llama(), dtype=torch.bfloat16)
    got = st.train.parameters(model)
    for name, value in fp32.items():
        assert torch.equal(got[name], value.to(torch.bfloat16)), name
    rt = model._strata_trainer.runtime
    for p in opt._train:  # the masters in the runtime, read back
        assert torch.equal(st.train._read_rows(rt, p)[0].view(p.shape), fp32[p.name]), p.name
    st.train.save_checkpoint(tmp_path, model, opt)  # before any step: no optimizer state yet
    _train("llama", model, opt, _batches("llama", 1))
    st.train.save_checkpoint(tmp_path, model, opt)
    from safetensors.torch import load_file

    saved = {}
    for f in tmp_path.glob("optimizer*.safetensors"):
        saved.update(load_file(f))
    assert len(saved) == 3 * len(opt._train)
    assert all(t.dtype == torch.float32 for t in saved.values())
