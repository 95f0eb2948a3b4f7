"""strata.torch on mixture-of-experts models (Note [Leased experts]): each routed expert leased
on its own when the router picks it, against transformers fully in memory with its eager experts
implementation: logits bit for bit for a prefill and for every token of greedy generation, with
budgets a quarter of the model, for Mixtral, Qwen3-MoE and Qwen2-MoE (shared experts); a batch
that routes to every expert, tokens routed to no cached expert, a checkpoint holding the fused
3-D tensors, pre-gating guesses that are wrong, experts computed where they are, int8 experts;
the cache's policy (hit density: frequency with aging over the layers until the next use, not
LRU); bad input named before anything runs.

Models are random-initialised from a config and written with save_pretrained (real safetensors
files), never downloaded."""

import shutil

import pytest
import strata
import strata.torch as st
import torch
import transformers
from safetensors.torch import save_file
from strata import Access, Tier
from strata.torch import _experts
from test_torch_models import DEVICE

VOCAB = 256
EXPERTS = 8
TOP_K = 2


def _configs():
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "num_experts_per_tok": TOP_K,
        "tie_word_embeddings": False,
    }
    return {
        # experts.{i}.w1/w3/w2 in the files, fused gate_up_proj/down_proj in the module
        "mixtral": transformers.MixtralConfig(
            **common, intermediate_size=64, num_local_experts=EXPERTS
        ),
        # experts.{i}.gate_proj/up_proj/down_proj; a head_dim and q/k norms of its own
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=64, num_experts=EXPERTS, head_dim=16
        ),
        # a shared expert and its gate beside the routed ones (dense: in the layer's block)
        "qwen2_moe": transformers.Qwen2MoeConfig(
            **common,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            num_experts=EXPERTS,
        ),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family, config in _configs().items():
        torch.manual_seed(4321)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(root / family)
        out[family] = root / family
    return out


def _model_bytes(path):
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _reference(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    return model.eval().to(DEVICE)


def _load(path, tmp_path, budget=None, **kwargs):
    budget = budget or _model_bytes(path) // 4
    tmp_path.mkdir(exist_ok=True)
    rt = st.make_runtime(DEVICE, budget, budget, tmp_path, nvme_capacity="64MiB")
    return st.load_model(path, device=DEVICE, runtime=rt, **kwargs)


def _ids(n, length, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, length), generator=g).to(DEVICE)


def _routed(ref, ids):
    """The experts transformers' router picks in each layer for `ids`: a set per layer."""
    with torch.no_grad():
        out = ref(ids, output_router_logits=True)
    return [set(torch.topk(r, TOP_K, dim=-1).indices.unique().tolist()) for r in out.router_logits]


def _expert_stats(model):
    return model.strata.stats()["experts"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_logits_and_every_greedy_token_equal_transformers_with_a_quarter_of_the_model(
    checkpoints, family, tmp_path
):
    path = checkpoints[family]
    model = _load(path, tmp_path)
    ref = _reference(path)
    budget = _model_bytes(path) // 4
    ids = _ids(3, 12)  # a batch of three sequences
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    # Only the experts the router picked were leased: per layer, as many as transformers' own
    # router chose (no layer leased whole).
    expected = _routed(ref, ids)
    layers = _expert_stats(model)["layers"]
    assert [v["routed"] for v in layers.values()] == [len(s) for s in expected]
    with torch.no_grad():
        ours = model.generate(
            ids[:1],
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        theirs = ref.generate(
            ids[:1],
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.logits) == 8
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits)):
        assert torch.equal(a, b), f"token {step}"
    stats = model.strata.stats()
    device = stats["runtime"]["tiers"]["Device"]
    assert device["peak_bytes"] <= budget and device["leased_bytes"] == 0
    experts = stats["experts"]
    assert experts["hits"] + experts["host_hits"] + experts["misses"] == experts["routed"]
    assert experts["misses"] > 0
    assert 0 <= experts["guessed_right"] <= experts["guessed"]
    assert 0.0 <= experts["guess_accuracy"] <= 1.0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_experts_back_to_back_tensors_are_one_lease(checkpoints, tmp_path, family):
    # Note [An expert in one piece]: save_pretrained writes expert i's tensors back to back
    # (Qwen: down_proj, gate_proj, up_proj; Mixtral: w1, w2, w3), so each expert is one strata
    # tensor over that run of its file. Qwen's gate_up slice (gate then up) is a view of it;
    # Mixtral's (w1 then w3, with w2 between) is joined from two views.
    path = checkpoints[family]
    model = _load(path, tmp_path)
    for layer in model.strata.experts.layers:
        for expert in layer.experts:
            assert len(expert.tensors) == 1, expert.tensors
            (run,) = expert.tensors
            assert run.nbytes == expert.nbytes
            elements = sum(p.numel for s in expert.slices.values() for p in s.parts)
            assert elements * 4 == run.nbytes  # float32: every byte of the run is some part's
            views = {attr: s.one_view() for attr, s in expert.slices.items()}
            assert views == {"gate_up_proj": family == "qwen3_moe", "down_proj": True}
    ref = _reference(path)
    ids = _ids(2, 7)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("compute", ["device", "auto"])
def test_experts_stay_on_their_tier_between_tokens(checkpoints, tmp_path, compute):
    # Budgets that hold the whole model: each expert is read once, at its first use; every
    # later token that routes to it finds it where it runs: the device tier, or on the host
    # backend with expert_compute="auto" the host tier (Note [Where an expert runs]).
    path = checkpoints["qwen3_moe"]
    model = _load(path, tmp_path, budget=2 * _model_bytes(path), expert_compute=compute)
    tier = Tier.HOST if compute == "auto" and DEVICE == "cpu" else Tier.DEVICE
    ref = _reference(path)
    ids = _ids(1, 4)
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(ours, ref.generate(ids, max_new_tokens=12, do_sample=False))
    stats = _expert_stats(model)
    cache = model.strata.experts
    one = cache.layers[0].experts[0].nbytes
    used = len(cache._score)  # the experts routed to at least once
    kept = [e for layer in cache.layers for e in layer.experts if cache._resident(e, tier)]
    # Nothing left the tier: every expert moved (used, or guessed) is there, moved once.
    tiers = model.strata.stats()["runtime"]["tiers"]
    assert tiers["Device"]["evictions"] == 0 and tiers["Host"]["evictions"] == 0
    assert len(kept) >= used and stats["bytes_moved"] == len(kept) * one
    assert stats["misses"] <= used
    found, other = ("hits", "host_hits") if tier is Tier.DEVICE else ("host_hits", "hits")
    assert stats[found] == stats["routed"] - stats["misses"] > stats["misses"]
    assert stats[other] == 0


def test_a_decode_step_reads_its_routed_experts_not_the_layer(checkpoints, tmp_path):
    # One token through a cold model: the bytes read from the files are the dense blocks and
    # the experts leased or guessed, far from the whole model.
    path = checkpoints["qwen3_moe"]
    model = _load(path, tmp_path)
    ids = _ids(1, 1)
    with torch.no_grad():
        model(ids)
    stats = model.strata.stats()
    experts = stats["experts"]
    dense = sum(b.nbytes for b in model.strata.blocks)
    one = model.strata.experts.layers[0].experts[0].nbytes
    read = stats["runtime"]["io"]["bytes_read"]
    tensors = stats["runtime"]["tensors"]
    # every read starts and ends on a 4 KiB boundary (O_DIRECT): at most 8 KiB more a tensor
    bound = dense + (experts["routed"] + experts["guessed"]) * one + 8192 * tensors
    assert experts["routed"] == 3 * TOP_K  # one token: top_k experts in each of 3 layers
    assert read <= bound
    assert read < 0.6 * _model_bytes(path)  # leased whole, the layers would be all of it


def test_a_batch_that_routes_to_every_expert(checkpoints, tmp_path):
    path = checkpoints["mixtral"]
    model = _load(path, tmp_path)
    ref = _reference(path)
    ids = _ids(4, 32, seed=11)
    assert all(len(s) == EXPERTS for s in _routed(ref, ids))  # every expert of every layer
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    layers = _expert_stats(model)["layers"]
    assert [v["routed"] for v in layers.values()] == [EXPERTS] * 3


def test_tokens_routed_to_no_cached_expert(checkpoints, tmp_path):
    path = checkpoints["qwen2_moe"]
    model = _load(path, tmp_path)
    ref = _reference(path)
    with torch.no_grad():
        model(_ids(1, 6))
    # Nothing of any expert is left on a tier: every expert the next batch needs is a miss.
    cache = model.strata.experts
    for layer in cache.layers:
        for expert in layer.experts:
            for t in expert.tensors:
                model.strata.runtime.evict(t, Tier.DEVICE)
                model.strata.runtime.evict(t, Tier.HOST)
    before = _expert_stats(model)
    ids = _ids(2, 5, seed=3)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    after = _expert_stats(model)
    routed = after["routed"] - before["routed"]
    assert routed == sum(len(s) for s in _routed(ref, ids))
    # The guesses made within this forward may have brought some ahead; none was cached before.
    assert after["hits"] - before["hits"] <= after["guessed_right"] - before["guessed_right"]
    assert after["host_hits"] == before["host_hits"]


def _fused_checkpoint(src, tmp_path):
    """The module's own state dict (3-D gate_up_proj/down_proj) written as one safetensors
    file, and the reference model."""
    ref = _reference(src)
    dst = tmp_path / "fused"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(
        {k: v.contiguous() for k, v in ref.state_dict().items()},
        dst / "model.safetensors",
        metadata={"format": "pt"},
    )
    return dst, ref


def test_a_checkpoint_of_fused_experts_is_sliced_in_place(checkpoints, tmp_path):
    # each expert's bytes are a range of the fused tensor, mapped as a tensor of its own.
    dst, ref = _fused_checkpoint(checkpoints["qwen3_moe"], tmp_path)
    model = _load(dst, tmp_path / "swap")
    names = [t.name for t in model.strata.experts.layers[1].experts[5].tensors]
    assert names == [
        "model.layers.1.mlp.experts.gate_up_proj[5]",
        "model.layers.1.mlp.experts.down_proj[5]",
    ]
    ids = _ids(2, 9)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        ours = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
        assert torch.equal(ours, ref.generate(ids[:1], max_new_tokens=6, do_sample=False))


def test_a_conversion_strata_cannot_slice_is_built_once_per_expert(
    checkpoints, tmp_path, monkeypatch
):
    # Note [Leased experts], third case: transformers' converter run for each expert alone, the
    # slice homed on the host tier (spilled to NVMe past the host budget).
    monkeypatch.setattr(_experts, "_per_expert_parts", lambda conversion, n: None)
    path = checkpoints["mixtral"]
    model = _load(path, tmp_path)
    names = [t.name for t in model.strata.experts.layers[2].experts[3].tensors]
    assert names == [
        "model.layers.2.mlp.experts.gate_up_proj[3]",
        "model.layers.2.mlp.experts.down_proj[3]",
    ]
    ref = _reference(path)
    ids = _ids(2, 9)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def _poor_guesses(model):
    # Each layer pre-gated with the router of another layer and the hidden states reversed: the
    # guesses are poor, the leased experts still those the real router picks.
    cache = model.strata.experts
    routers = dict(cache._routers)
    cache._routers = {i: routers[(i + 1) % len(routers)] for i in routers}
    guess = cache._guess
    cache._guess = lambda layer, hidden, room: guess(layer, -hidden.flip(0), room)


def test_wrong_guesses_cost_bandwidth_never_a_result(checkpoints, tmp_path):
    path = checkpoints["mixtral"]
    model = _load(path, tmp_path, expert_prefetch="all")  # every guess moves, from NVMe too
    ref = _reference(path)
    _poor_guesses(model)
    ids = _ids(2, 10)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        ours = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
        assert torch.equal(ours, ref.generate(ids[:1], max_new_tokens=6, do_sample=False))
    stats = _expert_stats(model)
    assert stats["guessed"] > stats["guessed_right"]


def test_a_guess_reads_no_storage_unless_every_guess_is_asked_to_move(checkpoints, tmp_path):
    # Note [Pre-gating]: under expert_prefetch="auto" a guessed expert only on NVMe waits for
    # its layer's router; "all" reads it for the guess.
    path = checkpoints["qwen3_moe"]
    ids = _ids(1, 1)
    for prefetch in ("auto", "all"):
        # half the model: room for the guesses beside a layer's own experts
        model = _load(path, tmp_path / prefetch, _model_bytes(path) // 2, expert_prefetch=prefetch)
        _poor_guesses(model)
        with torch.no_grad():
            model(ids)
        stats = model.strata.stats()
        experts = stats["experts"]
        one = model.strata.experts.layers[0].experts[0].nbytes
        assert experts["routed"] == 3 * TOP_K and experts["guessed"] > experts["guessed_right"]
        wrong = experts["guessed"] - experts["guessed_right"]
        if prefetch == "auto":  # the guesses are made and counted, and move nothing
            assert experts["bytes_moved"] == experts["routed"] * one
        else:  # guesses moved (those the room took), wrong ones besides the routed experts
            assert experts["routed"] * one < experts["bytes_moved"]
            assert experts["bytes_moved"] <= (experts["routed"] + wrong) * one
        dense = sum(b.nbytes for b in model.strata.blocks)
        read = stats["runtime"]["io"]["bytes_read"]  # O_DIRECT: each tensor's 4 KiB pages
        assert experts["bytes_moved"] + dense <= read
        assert read <= experts["bytes_moved"] + dense + 8192 * stats["runtime"]["tensors"]
    with pytest.raises(strata.InvalidArgumentError, match="expert_prefetch='some'"):
        _load(path, tmp_path / "bad", expert_prefetch="some")


@pytest.mark.parametrize("prefetch", ["auto", "all", "off"])
def test_guesses_most_likely_first_and_which_of_them_move(checkpoints, tmp_path, prefetch):
    # Note [Pre-gating]: the guess is the set of experts the next router's top_k picks for some
    # token, ordered by their summed probability; "auto" moves only guessed experts already on
    # a tier above storage, "off" none, "all" any.
    path = checkpoints["qwen3_moe"]
    # budgets that hold the model: an expert used once stays up, where the next guesses find it
    model = _load(path, tmp_path, 2 * _model_bytes(path), expert_prefetch=prefetch)
    cache = model.strata.experts
    rt = model.strata.runtime
    guessing = []  # (layer, chosen) of each guess
    moves = []  # (expert, on a tier above storage before) of each move a guess asked for
    guess, prefetch_guess, bring = cache._guess, cache._prefetch_guess, cache._bring

    def spy_guess(layer, hidden, room):
        nxt = cache.layers[layer.index + 1] if layer.index + 1 < len(cache.layers) else None
        if nxt is not None and nxt.index in cache._routers:
            tensor, shape = cache._routers[nxt.index]
            weight = torch.from_numpy(rt.read(tensor)).view(shape)
            probs = torch.softmax(hidden.float() @ weight.T.float(), -1)
            top = torch.topk(probs, nxt.top_k, dim=-1)
            want = set(top.indices.flatten().tolist())
            sums = {e: float(top.values[top.indices == e].sum()) for e in want}
            guessing.append((nxt.index, want, sums))
        guess(layer, hidden, room)

    def spy_prefetch_guess(layer, chosen, room):
        if guessing and guessing[-1][0] == layer.index:
            _, want, sums = guessing[-1]
            assert set(chosen) == want and len(chosen) == len(want)
            ordered = [sums[e] for e in chosen]
            assert all(a >= b - 1e-6 for a, b in zip(ordered, ordered[1:])), ordered
        cache._bring = lambda expert, stats, on=None: (
            moves.append(
                (expert, any(cache._resident(expert, t) for t in (Tier.DEVICE, Tier.HOST)))
            ),
            bring(expert, stats, on),
        )
        try:
            prefetch_guess(layer, chosen, room)
        finally:
            cache._bring = bring

    cache._guess, cache._prefetch_guess = spy_guess, spy_prefetch_guess
    ref = _reference(path)
    with torch.no_grad():
        for ids in (_ids(1, 6, seed=1), _ids(1, 6, seed=2), _ids(1, 6, seed=1)):  # cold, warm
            assert torch.equal(model(ids).logits, ref(ids).logits)
    assert guessing  # every guess checked against the router's own top_k
    if prefetch == "off":
        assert moves == []
    elif prefetch == "auto":
        assert moves and all(up for _, up in moves)  # never one only on storage
    else:
        assert any(not up for _, up in moves)  # read from NVMe for a guess


def test_an_expert_on_the_host_tier_is_computed_there(checkpoints, tmp_path):
    # The host backend (on every machine): host budget for the whole model, device budget a
    # quarter: experts found on the host tier are computed from their host copy (the same
    # kernel) instead of copied to the device arena.
    path = checkpoints["mixtral"]
    total = _model_bytes(path)
    ids = _ids(1, 4)
    runs = {}
    for how in ("auto", "device"):
        (tmp_path / how).mkdir()
        rt = st.make_runtime("cpu", total // 4, 2 * total, tmp_path / how, nvme_capacity="64MiB")
        model = st.load_model(path, runtime=rt, expert_compute=how)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=6, do_sample=False)  # warms both tiers
            logits = model(ids).logits
        runs[how] = (logits, model.strata.stats())
    assert torch.equal(runs["auto"][0], runs["device"][0])
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    assert torch.equal(runs["auto"][0], ref.eval()(ids).logits)
    auto, device = runs["auto"][1], runs["device"][1]
    assert auto["experts"]["host_hits"] > 0
    assert auto["experts"]["bytes_moved"] < device["experts"]["bytes_moved"]
    moved = auto["runtime"]["transfers"]["bytes_host_to_device"]
    assert moved < device["runtime"]["transfers"]["bytes_host_to_device"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA backend)")
def test_on_cuda_an_expert_on_the_host_tier_may_run_on_the_cpu(checkpoints, tmp_path):
    # Note [Where an expert runs]: "host" computes a host-resident expert on the CPU from its
    # pinned copy, "device" copies it to the GPU, "auto" picks from the measured rates. The CPU's
    # kernels are not the GPU's: the logits agree to rounding, the greedy tokens exactly.
    path = checkpoints["mixtral"]
    total = _model_bytes(path)
    ids = _ids(1, 4).to("cuda")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    ref = ref.eval().to("cuda")
    with torch.no_grad():
        want_logits = ref(ids).logits
        want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    stats = {}
    for how in ("host", "device", "auto"):
        (tmp_path / how).mkdir()
        rt = st.make_runtime("cuda", total // 4, 2 * total, tmp_path / how, nvme_capacity="64MiB")
        model = st.load_model(path, device="cuda", runtime=rt, expert_compute=how)
        with torch.no_grad():
            assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
            got = model(ids).logits
        torch.testing.assert_close(got, want_logits, rtol=1e-4, atol=1e-4)
        stats[how] = model.strata.stats()["experts"]
    assert stats["host"]["host_hits"] > 0
    assert stats["host"]["bytes_moved"] < stats["device"]["bytes_moved"]


def test_int8_experts_are_compressed_and_close(checkpoints, tmp_path):
    path = checkpoints["qwen3_moe"]
    model = _load(path, tmp_path, compress="int8", compress_cache=tmp_path / "cache")
    # per layer: q, k, v, o and gate_proj, up_proj, down_proj of each expert; the head
    assert model.strata.compression.compressed_tensors == 3 * (4 + 3 * EXPERTS) + 1
    ref = _reference(path)
    ids = _ids(2, 8)
    with torch.no_grad():
        ours, theirs = model(ids).logits.flatten(), ref(ids).logits.flatten()
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.999
    device = model.strata.stats()["runtime"]["tiers"]["Device"]
    assert device["dequantizations"] > 0


@pytest.mark.parametrize("compress", ["int8", "int4"])
def test_int4_and_int8_experts_of_a_fused_checkpoint_are_compressed_one_by_one(
    checkpoints, tmp_path, compress
):
    # Note [Leased experts]: each expert's slice of a fused 3-D tensor is a tensor of its own in
    # the compressed cache, quantized from the file's slice alone; the fused tensor never whole.
    dst, ref = _fused_checkpoint(checkpoints["qwen3_moe"], tmp_path)
    cache = tmp_path / "cache"
    model = _load(dst, tmp_path / "swap", compress=compress, compress_cache=cache)
    report = model.strata.compression
    # per layer: q, k, v, o and each expert's slice of gate_up_proj and down_proj; the head
    assert report.compressed_tensors == 3 * (4 + 2 * EXPERTS) + 1
    expert = model.strata.experts.layers[1].experts[5]
    assert [t.name for t in expert.tensors] == [
        "model.layers.1.mlp.experts.gate_up_proj[5]",
        "model.layers.1.mlp.experts.down_proj[5]",
    ]
    assert all(t.id in model.strata.experts._compressed for t in expert.tensors)
    # fp32 in int8: 1 byte a value and 4 a group of 64 (0.266); int4: half a byte (0.141)
    assert report.stored_bytes < report.full_bytes * (0.27 if compress == "int8" else 0.15)
    ids = _ids(2, 8)
    with torch.no_grad():
        ours, theirs = model(ids).logits, ref(ids).logits
    cos = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
    # measured 0.9999 (int8) and 0.987 (int4): what the scheme costs on random weights, whose
    # logits are nearly flat (the limits of test_compressed_models.py, whose reference checks
    # the scheme itself)
    assert cos > (0.9995 if compress == "int8" else 0.97), cos
    assert model.strata.stats()["runtime"]["tiers"]["Device"]["dequantizations"] > 0
    # The slice holds that expert's weights alone, quantized (not its neighbour's, not the
    # fused tensor's first rows).
    w = ref.model.layers[1].mlp.experts.down_proj[5].detach().cpu()
    want = strata.quant.dequantize(strata.quant.quantize(w, compress, 64), w.shape, compress, 64)
    again = _load(dst, tmp_path / "swap2", compress=compress, compress_cache=cache)
    assert again.strata.compression.rebuilt == []  # the cache is reused
    got = again.strata.runtime.read(again.strata.experts.layers[1].experts[5].tensors[1])
    assert got.shape == tuple(w.shape)
    assert torch.equal(torch.from_numpy(got), torch.as_tensor(want))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours)


# ---- the cache's policy ----------------------------------------------------------------------


def _policy_cache(tmp_path, n, share_experts):
    rt = st.make_runtime("cpu", "1MiB", "4MiB", tmp_path, nvme_capacity="16MiB")
    experts = []
    for e in range(n):
        t = rt.create_tensor(f"e{e}", (1024,), "float32", Tier.HOST)
        experts.append(
            _experts.Expert(
                0, e, {"w": _experts._Slice([_experts._whole(t)], 0, (1024,), torch.float32)}
            )
        )
    # top_k 0: no guess by frequency at a forward's start (Note [Pre-gating]), only the policy
    layer = _experts.ExpertLayer("experts", torch.nn.Module(), 0, experts, 0)
    cache = _experts.ExpertCache(
        rt, [layer], torch.device("cpu"), share_experts * 4096, 0, "device"
    )
    return rt, cache, experts


def _use(rt, cache, experts, used):
    cache.begin_forward()
    cache._enter(cache.layers[0], [])  # the layer runs (its experts unprotected: the policy alone)
    for e in used:
        with rt.acquire(experts[e].tensors[0], Tier.DEVICE, Access.READ):
            pass
        cache._used(experts[e])
        cache._keep(experts[e], Tier.DEVICE)


def _on_device(rt, experts):
    return {e.index for e in experts if rt.resident(e.tensors[0], Tier.DEVICE)}


def test_an_often_used_expert_outlives_a_burst_of_one_off_experts(tmp_path):
    rt, cache, experts = _policy_cache(tmp_path, 8, 3)
    for _ in range(5):
        _use(rt, cache, experts, [0])
    _use(rt, cache, experts, [1, 2, 3, 4])  # four experts used once, after expert 0
    # LRU would keep 2, 3, 4; routing frequency keeps 0 and the most recent of the others.
    assert _on_device(rt, experts) == {0, 3, 4}


def test_counts_age_so_an_expert_no_longer_used_gives_way(tmp_path):
    rt, cache, experts = _policy_cache(tmp_path, 8, 2)
    for _ in range(5):
        _use(rt, cache, experts, [0])
    for _ in range(30):  # forwards that use none of these experts
        cache.begin_forward()
    _use(rt, cache, experts, [1])
    _use(rt, cache, experts, [2])
    assert _on_device(rt, experts) == {1, 2}


def test_layers_run_in_a_cycle_keep_the_experts_next_to_run(tmp_path):
    # Four layers each routing to the same two experts every forward, a share of four experts:
    # a token uses twice the share. Evicting by recency (or by a count the forward's own uses
    # dominate) pushes each layer's experts out just before that layer runs again: no hit ever.
    # By hit density (Note [The expert cache]) the layers next to run keep theirs.
    rt = st.make_runtime("cpu", "1MiB", "4MiB", tmp_path, nvme_capacity="16MiB")
    layers = []
    for i in range(4):
        experts = []
        for e in range(2):
            t = rt.create_tensor(f"l{i}e{e}", (1024,), "float32", Tier.HOST)
            slices = {"w": _experts._Slice([_experts._whole(t)], 0, (1024,), torch.float32)}
            experts.append(_experts.Expert(i, e, slices))
        layers.append(_experts.ExpertLayer(f"layers.{i}.experts", torch.nn.Module(), i, experts, 0))
    cache = _experts.ExpertCache(rt, layers, torch.device("cpu"), 4 * 4096, 0, "device")
    hits = []
    for _ in range(6):
        cache.begin_forward()
        found = 0
        for layer in layers:
            cache._enter(layer, [0, 1])
            for expert in layer.experts:
                found += rt.resident(expert.tensors[0], Tier.DEVICE)
                with rt.acquire(expert.tensors[0], Tier.DEVICE, Access.READ):
                    pass
                cache._used(expert)
                cache._keep(expert, Tier.DEVICE)
        hits.append(found)
    # The first forward is cold; afterwards each forward finds at least one layer's experts
    # (the share holds two layers' worth: no policy finds more than four).
    assert hits[0] == 0 and all(2 <= h <= 4 for h in hits[1:]), hits
    kept = {
        (e.layer, e.index)
        for layer in layers
        for e in layer.experts
        if cache._resident(e, Tier.DEVICE)
    }
    assert len(kept) == 4


def test_layers_that_use_more_than_the_share_find_what_it_kept(checkpoints, tmp_path):
    # bench/moe-vs-accelerate.py's shape at test scale: the dense blocks stay on the device
    # tier and a forward's experts (3 layers x 2) exceed the share of the tier where they run
    # (4). One input again and again routes each layer to the same experts: a cycle of layers.
    # By recency nothing is ever found (each layer's experts go just before it runs again); by
    # hit density the share keeps those of the layers next to run. Nor may the runtime push a
    # kept expert out for a dense block's host copy, one the device tier also holds (Note
    # [Duplicates go first]): that had every warm token of the bench find none.
    path = checkpoints["qwen3_moe"]
    one = 3 * 64 * 64 * 4  # an expert: gate, up and down, 64 x 64 fp32 each
    largest = VOCAB * 64 * 4  # the embedding, the head
    if DEVICE == "cpu":  # experts run from the host tier (Note [Where an expert runs])
        device, host = "4MiB", 480_000
    else:
        device, host = 2 * largest + 2048 + 4 * one + one // 2, "4MiB"
    rt = st.make_runtime(DEVICE, device, host, tmp_path, nvme_capacity="64MiB")
    model = st.load_model(path, device=DEVICE, runtime=rt)
    cache = model.strata.experts
    assert cache.layers[0].experts[0].nbytes == one
    assert cache.share[cache._fetch] // one == 4
    ref = _reference(path)
    ids = _ids(1, 1)
    assert [len(s) for s in _routed(ref, ids)] == [2, 2, 2]
    found, pushed = [], []
    for i in range(6):
        if i < 2:  # cold: every copy dropped, the dense blocks come through the host tier
            model.strata.drop_caches()
        before = _expert_stats(model)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)
        after = _expert_stats(model)
        found.append(after["hits"] + after["host_hits"] - before["hits"] - before["host_hits"])
        pushed.append(after["pushed_out"] - before["pushed_out"])
    # Room for two layers' experts, the running one's among them: over a cycle of three layers
    # farthest next use (the best any policy does) finds a layer and a half, 3 experts, a
    # forward on average. Every warm forward finds at least a layer's.
    assert found[:2] == [0, 0] and all(2 <= f <= 4 for f in found[2:]), found
    assert sum(found[2:]) >= 3 * 4, found
    assert pushed[2:] == [0] * 4, pushed


# ---- bad input --------------------------------------------------------------------------------


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 8, 8))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.experts = _Experts()


def test_an_experts_module_of_unknown_layout_is_refused_before_anything_runs(tmp_path):
    net = _Net()
    save_file(
        {k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "net.safetensors"
    )
    rt = st.make_runtime("cpu", "1MiB", "1MiB", tmp_path)
    with pytest.raises(
        strata.UnsupportedError, match=r"experts module 'experts' \(_Experts\) has 3-D"
    ):
        st.offload(net, tmp_path / "net.safetensors", runtime=rt)
    assert rt.stats()["tensors"] == 0


def test_a_budget_below_a_dense_block_and_one_expert_is_named_with_both_numbers(
    checkpoints, tmp_path
):
    path = checkpoints["qwen3_moe"]
    model = _load(path, tmp_path)
    layer = next(b for b in model.strata.blocks if b.name == "model.layers.0")
    one = model.strata.experts.layers[0].experts[0].nbytes
    largest = max(b.nbytes for b in model.strata.blocks)
    budget = max(largest, layer.nbytes + one // 2)
    if budget >= layer.nbytes + one:
        pytest.fail("the test model's layer is not the largest block")
    (tmp_path / "small").mkdir()
    rt = st.make_runtime(DEVICE, budget, "8MiB", tmp_path / "small", nvme_capacity="16MiB")
    with pytest.raises(
        strata.OutOfMemoryError,
        match=rf"experts 'model.layers.0.mlp.experts': its layer's dense block 'model.layers.0' "
        rf"\({layer.nbytes} bytes\), its largest expert \({one} bytes\) and a router for "
        r"pre-gating \(\d+ bytes\) need \d+ bytes .* on the device tier at once, the device budget "
        r"is \d+ bytes",
    ):
        st.load_model(path, device=DEVICE, runtime=rt)
    assert rt.stats()["tensors"] == 0


def test_experts_whole_leases_each_layer_with_all_its_experts(checkpoints, tmp_path):
    path = checkpoints["qwen3_moe"]
    model = _load(path, tmp_path, budget=_model_bytes(path) // 2, experts="whole")
    assert model.strata.experts is None and "experts" not in model.strata.stats()
    layer = next(b for b in model.strata.blocks if b.name == "model.layers.0")
    assert "model.layers.0.mlp.experts.gate_up_proj" in [t.name for t in layer.tensors]
    with pytest.raises(strata.InvalidArgumentError, match="experts='some'"):
        _load(path, tmp_path, experts="some")
