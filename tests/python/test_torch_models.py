"""strata.torch: Hugging Face models run from their safetensors files with budgets at a third of
the model, against transformers' from_pretrained fully in memory (logits bit for bit, greedy
generation token for token); generic modules through offload(); and every bad input a clear
error that leaves nothing mapped or leased.

Models are random-initialised from a config and written with save_pretrained (real
safetensors files), never downloaded."""

import json
import shutil

import pytest
import strata
import strata.torch as st
import torch
import transformers
from conftest import BACKEND
from safetensors.torch import load_file, save_file

# STRATA_TEST_BACKEND=cuda (bench/gpu-check.sh): the same tests with device="cuda", against the
# reference moved to the GPU (the same kernels on both sides, so still bit for bit).
DEVICE = "cuda" if BACKEND == "cuda" else "cpu"


def _families():
    common = {"vocab_size": 2048, "max_position_embeddings": 128}
    llama = {
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return {
        # Llama with its own lm_head, written in 3 MB shards with an index.
        "llama": (transformers.LlamaConfig(**common, **llama, tie_word_embeddings=False), "1MB"),
        # Qwen2: attention biases, the head tied to the embedding.
        "qwen2": (transformers.Qwen2Config(**common, **llama, tie_word_embeddings=True), None),
        # GPT-2: Conv1D layers, learned positions, the head tied to the embedding.
        "gpt2": (
            transformers.GPT2Config(
                vocab_size=2048, n_positions=128, n_embd=96, n_layer=5, n_head=4
            ),
            None,
        ),
    }


def _write(path, family, dtype):
    config, shard = _families()[family]
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in _families():
        out[family] = _write(root / family, family, torch.float32)
    out["llama-bf16"] = _write(root / "llama-bf16", "llama", torch.bfloat16)
    return out


def _model_bytes(path):
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _reference(path, dtype=None):
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval().to(DEVICE)


def _third(path):
    return _model_bytes(path) // 3


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_logits_and_greedy_tokens_equal_from_pretrained_with_a_third_of_the_model(
    checkpoints, family
):
    path = checkpoints[family]
    budget = _third(path)
    model = st.load_model(path, device=DEVICE, device_budget=budget, host_budget=budget)
    ref = _reference(path, torch.float32)
    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        ours = model.generate(ids[:1], max_new_tokens=10, do_sample=False)
        theirs = ref.generate(ids[:1], max_new_tokens=10, do_sample=False)
    assert torch.equal(ours, theirs)
    stats = model.strata.stats()
    # Never more than the budget on the device tier; nothing leased between forwards.
    device = stats["runtime"]["tiers"]["Device"]
    assert device["peak_bytes"] <= budget and device["leased_bytes"] == 0
    # The pipeline followed every forward: 1 + 10 iterations of the same blocks, and after the
    # recorded first one it brought blocks ahead of their step.
    blocks = len(model.strata.blocks)
    assert stats["pipeline"]["steps"] == 11 * blocks
    assert stats["pipeline"]["prefetches"] > 0
    assert stats["pipeline"]["divergences"] == 0
    assert stats["pipeline"]["prefetch_failures"] == 0


def test_blocks_are_the_layers_and_the_modules_around_them(checkpoints):
    model = st.load_model(
        checkpoints["gpt2"], device=DEVICE, device_budget="8MiB", host_budget="8MiB"
    )
    names = [b.name for b in model.strata.blocks]
    assert names == [
        "transformer.wte",
        "transformer.wpe",
        *[f"transformer.h.{i}" for i in range(5)],
        "transformer.ln_f",
        "lm_head",
    ]
    # The tied head leases the embedding's tensor: one tensor in the runtime for both.
    wte = model.strata.blocks[0].tensors
    head = model.strata.blocks[-1].tensors
    assert [t.id for t in head] == [t.id for t in wte]
    # Outside a forward a parameter holds no bytes of its own: a NaN broadcast to its shape.
    w = model.transformer.h[0].mlp.c_fc.weight
    assert w.shape == (96, 384) and w.stride() == (0, 0) and torch.isnan(w[0, 0])
    assert model.device.type == DEVICE and model.dtype == torch.float32


def test_a_bf16_checkpoint_and_dtype_conversion(checkpoints):
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    bf16 = checkpoints["llama-bf16"]
    budget = _third(bf16)
    with torch.no_grad():
        # The file's dtype by default, as from_pretrained.
        model = st.load_model(bf16, device=DEVICE, device_budget=budget, host_budget=budget)
        assert model.dtype == torch.bfloat16
        assert torch.equal(model(ids).logits, _reference(bf16)(ids).logits)
        # fp32 weights converted to bf16 as they are leased, as from_pretrained(dtype=) does.
        f32 = checkpoints["llama"]
        model = st.load_model(
            f32, device=DEVICE, device_budget="4MiB", host_budget="4MiB", dtype="bfloat16"
        )
        ref = _reference(f32, torch.bfloat16)
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_offload_runs_any_module_whose_names_match_the_files(tmp_path):
    torch.manual_seed(3)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
        torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 10),
    )
    save_file(net.state_dict(), tmp_path / "net.safetensors")
    x = torch.randn(8, 64)
    expected = net(x).detach()
    torch.manual_seed(99)  # a fresh module with other weights: offload must replace them all
    fresh = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 256),
        torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 10),
    )
    handle = st.offload(
        fresh,
        checkpoint=tmp_path / "net.safetensors",
        device="cpu",
        device_budget="512KiB",
        host_budget="1MiB",
    )
    assert [b.name for b in handle.blocks] == ["0", "2", "3", "4"]
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(fresh(x), expected)
        assert torch.equal(fresh[2](torch.relu(fresh[0](x))), net[2](torch.relu(net[0](x))))
    rt = handle.runtime
    handle.remove()
    assert rt.stats()["tensors"] == 0


# ---- bad input: a clear error, nothing left mapped or leased ------------------------------


def _runtime():
    return st.make_runtime("cpu", "8MiB", "8MiB")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _fails_cleanly(path, error, match, **kwargs):
    rt = _runtime()
    with pytest.raises(error, match=match):
        st.load_model(path, runtime=rt, **kwargs)
    stats = rt.stats()
    assert stats["tensors"] == 0
    assert all(t["leased_bytes"] == 0 for t in stats["tiers"].values())


def test_a_missing_shard_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["llama"], tmp_path / "ck")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = max(set(index["weight_map"].values()))
    (path / shard).unlink()
    _fails_cleanly(path, strata.NotFoundError, f"shard '{shard}' named by .* is missing")


def test_a_tensor_missing_from_the_files_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["qwen2"], tmp_path / "ck")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _fails_cleanly(
        path,
        strata.NotFoundError,
        r"parameter 'model.layers.3.mlp.up_proj.weight' \(256, 96\) is in none of the "
        r"checkpoint's files \(.*model.safetensors\)",
    )


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(checkpoints, tmp_path):
    path = _copy(checkpoints["gpt2"], tmp_path / "ck")
    tensors = load_file(path / "model.safetensors")
    name = next(n for n in tensors if n.endswith("h.2.attn.c_attn.weight"))
    tensors[name] = torch.zeros(96, 200)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _fails_cleanly(
        path,
        strata.InvalidArgumentError,
        rf"tensor '{name}' in '.*model.safetensors' has shape \(96, 200\), parameter "
        r"'transformer.h.2.attn.c_attn.weight' of the model \(96, 288\)",
    )


def test_a_file_that_is_not_safetensors_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["gpt2"], tmp_path / "ck")
    (path / "model.safetensors").write_bytes(b"\xff" * 64 + b"not a safetensors file")
    _fails_cleanly(path, strata.CorruptDataError, "model.safetensors")


def test_a_block_larger_than_the_device_budget_is_named_before_anything_runs(checkpoints):
    # The embedding is 2048 x 96 float32 = 786432 bytes.
    rt = st.make_runtime("cpu", "512KiB", "8MiB")
    with pytest.raises(
        strata.OutOfMemoryError,
        match=(
            r"block 'model.embed_tokens' needs 786432 bytes \(0.8 MiB\) on the device tier, the "
            r"device budget is 524288 bytes \(0.5 MiB\)"
        ),
    ):
        st.load_model(checkpoints["llama"], runtime=rt)
    assert rt.stats()["tensors"] == 0


def test_a_directory_without_a_config_is_named(tmp_path):
    with pytest.raises(strata.NotFoundError, match="no config.json"):
        st.load_model(tmp_path)
