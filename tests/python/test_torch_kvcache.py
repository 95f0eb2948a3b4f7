"""strata.torch.KVCache: keys and values in pages on the tiers, against transformers' DynamicCache
in memory: every greedy token and every step's logits equal bit for bit, on Llama and on Qwen2
(biases, GQA), with a context whose KV is larger than the device and host budgets together, so
NVMe holds part of it; batches, sampling and beam search; int8 pages; a model run by
st.load_model sharing its runtime; a step that meets an EIO or a full disk raising, naming the
layer and page, and leaving the cache as it was for the step to run again; budgets too small
refused with both numbers.

Models are random-initialised from a config, never downloaded."""

import pytest
import strata
import strata.torch as st
import torch
import transformers
from conftest import BACKEND

DEVICE = "cuda" if BACKEND == "cuda" else "cpu"
if BACKEND == "cuda" and not torch.cuda.is_available():
    pytest.skip("STRATA_TEST_BACKEND=cuda needs a GPU", allow_module_level=True)


def _config(family):
    common = {
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "hidden_size": 96,
        "intermediate_size": 192,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA
    }
    if family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common)  # q, k, v biases


def _model(family, dtype=torch.float32):
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(_config(family), dtype=dtype)
    return model.eval().to(DEVICE)


def _runtime(tmp_path, device="64KiB", host="320KiB", nvme="16MiB", faults=()):
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir(parents=True, exist_ok=True)
    return strata.Runtime(
        {
            "backend": BACKEND,
            "device_budget": device,
            "host_budget": host,  # 64 KiB of it is staging
            "staging_chunk": "32KiB",
            "staging_chunks": 2,
            "nvme": {"paths": [str(nvme_dir)], "capacity": nvme, "stripe": "64KiB"},
            "io": {"faults": list(faults), "block": "64KiB"},
            "quiet": True,
        }
    )


def _ids(batch, length, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (batch, length), generator=g).to(DEVICE)


def _generate(model, ids, cache=None, **kw):
    kw = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0, **kw}
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )


def _same(ref, out):
    assert torch.equal(ref.sequences, out.sequences)
    assert len(ref.logits) == len(out.logits)
    for step, (a, b) in enumerate(zip(ref.logits, out.logits)):
        assert torch.equal(a, b), f"logits of step {step} differ"


def _kv_bytes(model, batch, tokens, element=4):
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * batch * c.num_key_value_heads * tokens * head_dim * element


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tokens_and_logits_equal_dynamic_cache_with_nvme_holding_part(tmp_path, family):
    model = _model(family)
    ids = _ids(2, 360)
    ref = _generate(model, ids)
    rt = _runtime(tmp_path)
    cache = st.KVCache(model, runtime=rt, page_tokens=16)
    out = _generate(model, ids, cache)
    _same(ref, out)
    s = cache.stats()
    total = _kv_bytes(model, 2, 360 + 23)
    caps = rt.stats()["tiers"]
    assert total > caps["Device"]["capacity_bytes"] + caps["Host"]["capacity_bytes"]
    assert s["tokens"] == 360 + 23
    assert s["pages"] == 3 * -(-(360 + 23) // 16)
    assert s["home"] == "nvme"
    assert s["bytes"]["nvme"] > 0
    assert s["nvme_bytes_written"] > 0
    assert s["nvme_bytes_read"] > 0  # pages came back from NVMe ahead of their layer
    assert s["bytes"]["device"] <= caps["Device"]["capacity_bytes"]


def test_a_step_reads_from_nvme_only_the_pages_the_upper_tiers_do_not_hold(tmp_path):
    # Note [Streamed pages]: under LRU a cyclic scan larger than the host tier would miss on
    # every page; the pages the device and host tiers hold stay there and hit every step.
    model = _model("llama")
    rt = _runtime(tmp_path)
    cache = st.KVCache(model, runtime=rt, page_tokens=16)
    up = (strata.Tier.DEVICE, strata.Tier.HOST)

    def only_on_nvme():
        return sum(
            p.nbytes
            for layer in cache.layers
            for p in layer.pages
            if not any(rt.resident(p, t) for t in up)
        )

    with torch.no_grad():
        logits = model(_ids(1, 600), cache=cache, use_cache=True).logits
        for step in range(5):  # 600..605 tokens: no new page
            s = cache.stats()
            # A page a prefetch is bringing up for this step was counted in the step before,
            # as this step counts those it starts for the next (the same pages, steadily).
            must_move = only_on_nvme() + s["bytes_on_the_way"]
            logits = model(logits[:, -1:].argmax(-1), cache=cache, use_cache=True).logits
            read = cache.stats()["nvme_bytes_read"] - s["nvme_bytes_read"]
            assert s["bytes"]["host"] > 0 and s["bytes"]["nvme"] > 0 and must_move > 0
            if step > 0:  # the first settles which pages stay up
                assert read == must_move, step


def test_the_next_layers_moving_pages_are_read_while_a_layer_attends(tmp_path):
    # Note [Streamed pages]: update() of layer L ends by starting the moves of layer L+1's first
    # `depth` pages that are not on their read tier, skipping those that are; once those moves
    # have landed, L+1's read finds every one of them arrived.
    model = _model("llama")
    rt = _runtime(tmp_path)
    cache = st.KVCache(model, runtime=rt, page_tokens=16)
    with torch.no_grad():
        logits = model(_ids(1, 600), cache=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        for _ in range(2):  # the first steps settle which pages stay up
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    layer = cache.layers[1]
    depth = layer.depth
    # Layer 1's closed pages on NVMe only, in order: what its read must move.
    up = (strata.Tier.DEVICE, strata.Tier.HOST)
    moving = [i for i, p in enumerate(layer.pages[:-1]) if not any(rt.resident(p, t) for t in up)]
    assert len(moving) > depth + 1 and depth >= 2
    read = strata.Tier.HOST if BACKEND == "host" else strata.Tier.DEVICE
    rt.acquire(layer.pages[moving[1]], read).release()  # one of the first now up: skipped
    moving.pop(1)
    b, h, d = layer.batch_size, layer.heads, layer.head_dim
    new = torch.zeros(b, h, 1, d)
    before = cache.stats()
    with torch.no_grad():
        cache.update(new, new, 0)  # ends by prefetching layer 1's first `depth` moving pages
        rt.synchronize()  # they have landed
        for i in moving[:depth]:
            assert rt.resident(layer.pages[i], read), i
        for i in moving[depth:]:  # the rest wait for layer 1's own read
            assert not rt.resident(layer.pages[i], read), i
        cache.update(new, new, 1)
    after = cache.stats()
    assert after["pages_moved"] - before["pages_moved"] >= len(moving)
    assert after["prefetch_hits"] - before["prefetch_hits"] >= depth
    assert after["bytes_on_the_way"] > 0  # layer 2's first pages
    cache.reset()  # every page destroyed: no record of one on its way outlives it
    assert cache._prefetched == {} and cache.stats()["bytes_on_the_way"] == 0


def test_budgets_given_to_the_cache_make_its_runtime(tmp_path):
    model = _model("llama")
    ids = _ids(1, 100)
    ref = _generate(model, ids, max_new_tokens=8)
    cache = st.KVCache(
        model,
        device_budget="128KiB",
        host_budget="4MiB",
        nvme_dir=tmp_path,
        nvme_capacity="8MiB",
        page_tokens=32,
    )
    _same(ref, _generate(model, ids, cache, max_new_tokens=8))
    assert cache.stats()["home"] == "nvme"
    cache = st.KVCache(model, device_budget="128KiB", host_budget="4MiB", page_tokens=32)
    assert cache.stats()["home"] == "host"  # no nvme_dir: the pages stay on the host tier
    _same(ref, _generate(model, ids, cache, max_new_tokens=8))


def test_a_left_padded_batch_sampling_and_beam_search(tmp_path):
    model = _model("qwen2")
    ids = _ids(3, 70)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0  # left padding
    mask[2, :30] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = {"max_new_tokens": 12, "pad_token_id": 0, "output_logits": True}
    kw["return_dict_in_generate"] = True
    cases = [
        {"do_sample": False},
        {"do_sample": True, "top_k": 20, "temperature": 0.9},
        {"do_sample": False, "num_beams": 3, "num_return_sequences": 2},
    ]
    for case in cases:
        with torch.no_grad():
            torch.manual_seed(11)
            ref = model.generate(ids, attention_mask=mask, **kw, **case)
            rt = _runtime(tmp_path, device="320KiB")  # 9 sequences with the beams
            cache = st.KVCache(model, runtime=rt, page_tokens=16)
            torch.manual_seed(11)
            out = model.generate(ids, attention_mask=mask, cache=cache, **kw, **case)
        _same(ref, out)


def test_int8_pages_store_half_the_bytes_and_stay_close(tmp_path):
    model = _model("llama", torch.bfloat16)
    ids = _ids(1, 300)
    ref = _generate(model, ids, max_new_tokens=16)
    runs = {}
    for compress in (None, "int8"):
        cache = st.KVCache(
            model, runtime=_runtime(tmp_path / str(compress)), page_tokens=32, compress=compress
        )
        (tmp_path / str(compress)).mkdir(exist_ok=True)
        out = _generate(model, ids, cache, max_new_tokens=16)
        runs[compress] = (out, cache.stats())
    _same(ref, runs[None][0])
    full, packed = runs[None][1], runs["int8"][1]
    assert packed["compressed_pages"] == 3 * ((300 + 15) // 32)  # every closed page
    # A page of [2, 1, 2, 32, 24] bfloat16 is 6144 bytes; closed and int8, its 3072 codes and
    # an fp16 min and step per group of 24 (head_dim): 3584. The open pages stay full width.
    assert full["stored_bytes"] == 30 * 6144
    assert packed["stored_bytes"] == 27 * 3584 + 3 * 6144
    # Not equal (the keys and values are approximations), but the same model's answer.
    out = runs["int8"][0]
    first = torch.stack(out.logits).float()
    want = torch.stack(ref.logits).float()
    assert (first - want).abs().max() < 0.1 * want.abs().max()
    assert (out.sequences == ref.sequences).float().mean() > 0.9


def test_a_model_run_by_load_model_shares_its_runtime(tmp_path):
    model = _model("llama")
    path = tmp_path / "ckpt"
    model.save_pretrained(path)
    ids = _ids(1, 120)
    ref = _generate(model, ids, max_new_tokens=10)
    run = st.load_model(path, device=DEVICE, device_budget="1MiB", host_budget="2MiB")
    cache = st.KVCache(run, page_tokens=16)
    assert cache.runtime is run.strata.runtime
    # Its pages are leased inside the model's blocks: no block may arrive over the running one's
    # room meanwhile (that deadlocked, 1 run in 8; Note [Arrival in pieces]).
    assert run.strata.pipeline.options["arrival_in_pieces"] is False
    _same(ref, _generate(run, ids, cache, max_new_tokens=10))
    with pytest.raises(strata.InvalidArgumentError, match="shares its runtime"):
        st.KVCache(run, host_budget="1GiB")


def _greedy_steps(model, cache, ids, steps):
    """Prefill, then `steps` greedy tokens, one forward each; returns the tokens."""
    tokens = []
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            logits = model(nxt, cache=cache, use_cache=True).logits
    return torch.cat(tokens, 1)


def test_an_eio_reading_a_page_names_it_and_the_step_runs_again(tmp_path):
    model = _model("llama")
    ids = _ids(1, 300)
    want = _greedy_steps(
        model, st.KVCache(model, runtime=_runtime(tmp_path / "a"), page_tokens=16), ids, 6
    )
    # The Nth NVMe read fails (a 6 KiB page is two: its whole 4 KiB pages and the rest). One that
    # a prefetch meets is absorbed (the lease reads the page again); one a lease meets raises.
    fired = 0
    for n in (3, 17, 40, 61):
        (tmp_path / f"f{n}").mkdir()
        rt = _runtime(tmp_path / f"f{n}", faults=[f"read:{n}:eio"])
        cache = st.KVCache(model, runtime=rt, page_tokens=16)
        tokens = []
        with torch.no_grad():
            logits = model(ids, cache=cache, use_cache=True).logits
            for _ in range(6):
                nxt = logits[:, -1:].argmax(-1)
                tokens.append(nxt)
                before = [layer.get_seq_length() for layer in cache.layers]
                try:
                    logits = model(nxt, cache=cache, use_cache=True).logits
                except strata.IoError as e:
                    fired += 1
                    assert "KVCache layer" in str(e) and "page" in str(e), str(e)
                    assert [layer.get_seq_length() for layer in cache.layers] == before
                    logits = model(nxt, cache=cache, use_cache=True).logits  # again
        assert torch.equal(torch.cat(tokens, 1), want)
        assert rt.stats()["io"]["failed_requests"] == 1  # it fired, raised or absorbed
    assert fired >= 1


def test_nvme_full_names_the_tier_and_bytes_and_keeps_the_cache(tmp_path):
    model = _model("llama")
    rt = _runtime(tmp_path, nvme="192KiB")
    cache = st.KVCache(model, runtime=rt, page_tokens=16)
    ids = _ids(1, 64)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        step = _ids(1, 16, seed=5)
        with pytest.raises(strata.Error, match=r"(?i)nvme") as info:
            for _ in range(40):
                before = cache.get_seq_length()
                model(step, cache=cache, use_cache=True)
    assert "KVCache layer" in str(info.value)
    assert "bytes" in str(info.value) or "MiB" in str(info.value) or "KiB" in str(info.value)
    assert all(layer.get_seq_length() == before for layer in cache.layers)


def test_enospc_writing_a_page_down_raises_and_loses_nothing(tmp_path):
    model = _model("llama")
    ids = _ids(1, 300)
    want = _greedy_steps(
        model, st.KVCache(model, runtime=_runtime(tmp_path / "a"), page_tokens=16), ids, 4
    )
    (tmp_path / "b").mkdir()
    rt = _runtime(tmp_path / "b", faults=[f"write:{n}:enospc" for n in range(2, 6)])
    cache = st.KVCache(model, runtime=rt, page_tokens=16)
    tokens, raised = [], 0
    with torch.no_grad():
        for attempt in range(8):
            try:
                logits = model(ids, cache=cache, use_cache=True).logits
                break
            except strata.IoError as e:
                raised += 1
                assert "KVCache layer" in str(e), str(e)
                assert cache.get_seq_length() == 0
                assert all(layer.get_seq_length() == 0 for layer in cache.layers)
        for _ in range(4):
            nxt = logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            logits = model(nxt, cache=cache, use_cache=True).logits
    assert raised >= 1
    assert torch.equal(torch.cat(tokens, 1), want)


def test_a_budget_smaller_than_a_layers_working_pages_is_refused_with_both_numbers(tmp_path):
    model = _model("llama")
    with pytest.raises(strata.OutOfMemoryError, match=r"working pages .*MiB.* Device .*MiB"):
        st.KVCache(model, runtime=_runtime(tmp_path, device="64KiB"), page_tokens=256)
    cache = st.KVCache(model, runtime=_runtime(tmp_path, device="64KiB"), page_tokens=32)
    with pytest.raises(strata.OutOfMemoryError, match=r"\[2, 8, 2, 32, 24\]"):
        _generate(model, _ids(8, 10), cache, max_new_tokens=2)  # a batch of 8: pages 8x
    with pytest.raises(strata.InvalidArgumentError, match="page_tokens"):
        st.KVCache(model, runtime=_runtime(tmp_path), page_tokens=0)
    with pytest.raises(strata.InvalidArgumentError, match="compress"):
        st.KVCache(model, runtime=_runtime(tmp_path), compress="int4")


def test_a_sliding_window_model_is_refused_by_name():
    config = _config("qwen2")
    config.use_sliding_window = True
    config.sliding_window = 16
    config.max_window_layers = 1
    config.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(strata.UnsupportedError, match="sliding_attention"):
        st.KVCache(model, host_budget="64MiB")


def test_crop_and_reset_give_the_tokens_back(tmp_path):
    model = _model("llama", torch.bfloat16)
    ids = _ids(1, 100)
    for compress in (None, "int8"):
        (tmp_path / str(compress)).mkdir()
        cache = st.KVCache(
            model, runtime=_runtime(tmp_path / str(compress)), page_tokens=16, compress=compress
        )
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
            cache.crop(-37)  # into a closed (for int8: compressed) page
            assert cache.get_seq_length() == 63
            tail = model(ids[:, 63:], cache=cache, use_cache=True).logits
            cache.reset()
            assert cache.get_seq_length() == 0 and cache.stats()["pages"] == 0
            again = model(ids, cache=cache, use_cache=True).logits
            ref_cache = transformers.DynamicCache()
            full = model(ids, cache=ref_cache, use_cache=True).logits
        if compress is None:
            assert torch.equal(again, full)
            ref_cache.crop(-37)
            with torch.no_grad():
                want = model(ids[:, 63:], cache=ref_cache, use_cache=True).logits
            assert torch.equal(tail, want)
        else:
            assert cache.stats()["compressed_pages"] == 3 * (100 // 16)
