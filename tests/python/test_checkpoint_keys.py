"""strata.torch maps checkpoint keys to module names with transformers' own conversion mapping
(Note [Checkpoint keys]): checkpoints written by the installed transformers, for every family
the other tests use plus GPT-NeoX (its head `lm_head` stored as `embed_out.weight`) and Mixtral
(its fused experts stored one tensor per expert), load with budgets at a third of the model and
give from_pretrained's logits bit for bit; a tensor the checkpoint lacks is named.

Models are random-initialised from a config and written with save_pretrained, never
downloaded."""

import shutil

import pytest
import strata
import strata.torch as st
import torch
import transformers
from safetensors.torch import load_file, save_file
from strata.torch import _keys
from test_torch_models import DEVICE, _families, _third

VOCAB = 2048


def _all_families():
    out = dict(_families())
    small = {"vocab_size": VOCAB, "max_position_embeddings": 128, "hidden_size": 96}
    # GPT-NeoX: transformers >= 5 calls its head `lm_head`, its checkpoints `embed_out`.
    out["gpt_neox"] = (
        transformers.GPTNeoXConfig(
            **small,
            intermediate_size=256,
            num_hidden_layers=5,
            num_attention_heads=4,
            tie_word_embeddings=False,
        ),
        None,
    )
    # Mixtral: experts fused in the module (gate_up_proj, down_proj), stored per expert.
    out["mixtral"] = (
        transformers.MixtralConfig(
            **small,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        None,
    )
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    out = {}
    for family, (config, shard) in _all_families().items():
        torch.manual_seed(1234)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(root / family, **({"max_shard_size": shard} if shard else {}))
        out[family] = root / family
    return out


def _keys_of(path):
    keys = set()
    for f in path.glob("*.safetensors"):
        keys |= set(load_file(f))
    return keys


def _reference(path):
    # strata computes a routed expert as transformers' eager experts implementation does (Note
    # [Leased experts]); the default one (grouped matrix products, where torch has them) sums in
    # another order. Models without experts ignore it.
    model = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    return model.eval().to(DEVICE)


def _runtime(budget, nvme_dir):
    # Swap on disk for the host-homed fused experts past the host budget (Note [Converted
    # parameters]), sized for these models rather than make_runtime's default.
    return st.make_runtime(DEVICE, budget, budget, nvme_dir, nvme_capacity="64MiB")


def _ids(n=2, length=20):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "gpt_neox", "mixtral"])
def test_a_checkpoint_of_the_installed_transformers_gives_from_pretrained_logits(
    checkpoints, family, tmp_path
):
    path = checkpoints[family]
    budget = _third(path)
    model = st.load_model(path, device=DEVICE, runtime=_runtime(budget, tmp_path))
    ref = _reference(path)
    ids = _ids().to(DEVICE)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        if family in ("gpt_neox", "mixtral"):
            ours = model.generate(ids[:1], max_new_tokens=8, do_sample=False)
            theirs = ref.generate(ids[:1], max_new_tokens=8, do_sample=False)
            assert torch.equal(ours, theirs)
    device = model.strata.stats()["runtime"]["tiers"]["Device"]
    assert device["peak_bytes"] <= budget and device["leased_bytes"] == 0


def test_gpt_neox_head_is_leased_from_embed_out(checkpoints):
    path = checkpoints["gpt_neox"]
    keys = _keys_of(path)
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys
    model = st.load_model(path, device=DEVICE, device_budget="4MiB", host_budget="4MiB")
    head = next(b for b in model.strata.blocks if b.name == "lm_head")
    assert [t.name for t in head.tensors] == ["embed_out.weight"]


def test_fused_experts_are_built_once_from_the_per_expert_tensors(
    checkpoints, tmp_path, monkeypatch
):
    path = checkpoints["mixtral"]
    keys = _keys_of(path)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    builds = []
    build = _keys.Conversion.build

    def counted(self, read, model=None):
        builds.append(self.first)
        return build(self, read, model)

    monkeypatch.setattr(_keys.Conversion, "build", counted)
    budget = _third(path)
    # experts="whole": each layer leased with all its experts, as a dense layer.
    model = st.load_model(path, device=DEVICE, runtime=_runtime(budget, tmp_path), experts="whole")
    with torch.no_grad():
        model.generate(_ids(1).to(DEVICE), max_new_tokens=4, do_sample=False)
    # gate_up_proj and down_proj of each of the 4 layers: each built once, at load.
    assert sorted(builds) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in range(4) for p in ("gate_up_proj", "down_proj")
    )
    # The fused tensor is a runtime tensor of its layer's block, as any other weight.
    layer = next(b for b in model.strata.blocks if b.name == "model.layers.2")
    assert "model.layers.2.mlp.experts.gate_up_proj" in [t.name for t in layer.tensors]
    gate_up = next(t for t in layer.tensors if t.name.endswith("gate_up_proj"))
    assert gate_up.shape == (4, 256, 96)


@pytest.mark.parametrize("family", ["gpt_neox", "mixtral"])
def test_compression_follows_the_mapped_keys(checkpoints, family, tmp_path):
    # A renamed linear weight (GPT-NeoX's embed_out) is compressed under its checkpoint key, and
    # so is each of Mixtral's per-expert tensors (w1, w2, w3: leased one by one).
    path = checkpoints[family]
    model = st.load_model(
        path,
        device=DEVICE,
        runtime=_runtime("4MiB", tmp_path),
        compress="int8",
        compress_cache=tmp_path,
    )
    layers = 5 if family == "gpt_neox" else 4
    # GPT-NeoX: qkv, dense, h_to_4h, 4h_to_h; Mixtral: q, k, v, o and 3 per each of 4 experts
    per_layer = 4 if family == "gpt_neox" else 4 + 3 * 4
    assert model.strata.compression.compressed_tensors == layers * per_layer + 1  # and the head
    ids = _ids(1).to(DEVICE)
    with torch.no_grad():
        ours, theirs = model(ids).logits.flatten(), _reference(path)(ids).logits.flatten()
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.999


def test_experts_are_stacked_in_natural_order():
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=12,
    )
    with st.parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    layer = "model.layers.0.block_sparse_moe"
    names = [f"{layer}.experts.{e}.w{w}.weight" for e in range(12) for w in (1, 2, 3)]
    names += [f"{layer}.gate.weight", "model.embed_tokens.weight", "lm_head.weight"]
    keys = _keys.checkpoint_keys(model, reversed(names))
    conversion = keys.conversion_of("model.layers.0.mlp.experts.gate_up_proj")
    assert conversion.keys == [
        f"{layer}.experts.{e}.w{w}.weight" for w in (1, 3) for e in range(12)
    ]
    assert keys.key_of("model.layers.0.mlp.gate.weight", names) == f"{layer}.gate.weight"
    assert keys.key_of("lm_head.weight", names) == "lm_head.weight"


def test_a_module_transformers_does_not_know_keeps_its_names():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    keys = _keys.checkpoint_keys(net, ["0.weight", "0.bias"])
    assert keys.key_of("0.weight", {"0.weight", "0.bias"}) == "0.weight"
    assert keys.conversions() == []


# ---- a tensor the checkpoint lacks: an error naming the parameter, nothing left mapped -------


def _without(src, dst, name):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors[name]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _fails_cleanly(path, error, match, **kwargs):
    rt = st.make_runtime("cpu", "8MiB", "8MiB")
    with pytest.raises(error, match=match):
        st.load_model(path, runtime=rt, **kwargs)
    stats = rt.stats()
    assert stats["tensors"] == 0
    assert all(t["leased_bytes"] == 0 for t in stats["tiers"].values())


def test_a_missing_head_names_the_parameter_and_the_rename_tried(checkpoints, tmp_path):
    path = _without(checkpoints["gpt_neox"], tmp_path / "ck", "embed_out.weight")
    _fails_cleanly(
        path,
        strata.NotFoundError,
        r"parameter 'lm_head.weight' \(2048, 96\) is in none of the checkpoint's files "
        r"\(.*model.safetensors\): tried 'lm_head.weight', 'gpt_neox.lm_head.weight' and "
        r"transformers' conversion mapping for GPTNeoXForCausalLM \(\^embed_out\\\. -> lm_head\.",
    )


def test_a_missing_layer_tensor_names_the_parameter(checkpoints, tmp_path):
    name = "gpt_neox.layers.3.mlp.dense_h_to_4h.weight"
    path = _without(checkpoints["gpt_neox"], tmp_path / "ck", name)
    _fails_cleanly(
        path,
        strata.NotFoundError,
        rf"parameter '{name}' \(256, 96\) is in none of the checkpoint's files "
        r"\(.*model.safetensors\): tried ",
    )


def test_a_missing_expert_names_its_tensor(checkpoints, tmp_path):
    # Experts leased one by one (the default): the tensor the checkpoint lacks is named.
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    path = _without(checkpoints["mixtral"], tmp_path / "ck", name)
    _fails_cleanly(
        path,
        strata.NotFoundError,
        r"experts 'model.layers.1.mlp.experts.down_proj': the checkpoint has no tensor "
        rf"'{name}' \(transformers' MergeModulelist of 3 checkpoint tensors\)",
    )


def test_a_missing_expert_names_the_fused_parameter_when_layers_are_leased_whole(
    checkpoints, tmp_path
):
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    path = _without(checkpoints["mixtral"], tmp_path / "ck", name)
    _fails_cleanly(
        path,
        strata.InvalidArgumentError,
        r"tensor 'model.layers.1.mlp.experts.down_proj' in '.*model.safetensors', built by "
        r"transformers' MergeModulelist of 3 checkpoint tensors, has shape \(3, 96, 128\), "
        r"parameter 'model.layers.1.mlp.experts.down_proj' of the model \(4, 96, 128\)",
        experts="whole",
    )
