import dataclasses

import pytest

from unified_kv import CacheSpec, CacheSpecError, LayerSpec, bucket_width, max_live_pages
from unified_kv.spec import size_pools


def mixed_layers(num_target=4, num_draft=2, window=64):
    """A target with alternating windowed/full fp8 layers plus a windowed bf16 drafter."""
    target = [LayerSpec(f"target.{i}", "target", 4, 32, "fp8_e4m3",
                        window if i % 2 else None, k_scale=0.5, v_scale=0.25)
              for i in range(num_target)]
    draft = [LayerSpec(f"draft.{i}", "draft", 4, 32, "bf16", window) for i in range(num_draft)]
    return tuple(target + draft)


def make_spec(**overrides):
    args = dict(page_size=16, layers=mixed_layers(), num_slots=4, max_seq_len=512,
                memory_budget_bytes=64 << 20, max_step_tokens=16)
    args.update(overrides)
    return CacheSpec(**args)


def test_three_pools_for_mixed_target_and_windowed_drafter():
    spec = make_spec()
    pools = spec.pools
    assert len(pools) == 3
    assert [p.layer_names for p in pools] == [
        ("target.0", "target.2"), ("target.1", "target.3"), ("draft.0", "draft.1")]
    assert [(p.kv_dtype, p.sliding_window) for p in pools] == [
        ("fp8_e4m3", None), ("fp8_e4m3", 64), ("bf16", 64)]
    assert spec.layer_location("target.3") == (1, 1)
    assert spec.layer_location("draft.0") == (2, 0)
    # Page-index scale covers K and V of every layer in the pool.
    assert [p.page_index_scale for p in pools] == [4, 4, 4]
    assert pools[0].bytes_per_page == 4 * 2 * 2 * 16 * 32 * 1
    assert pools[2].bytes_per_page == 4 * 2 * 2 * 16 * 32 * 2


def test_target_and_draft_share_a_pool_when_pool_keys_match():
    layers = (LayerSpec("t0", "target", 2, 64, "bf16", 32),
              LayerSpec("d0", "draft", 2, 64, "bf16", 32))
    spec = make_spec(layers=layers)
    assert len(spec.pools) == 1
    assert spec.pools[0].roles == {"target", "draft"}


def test_budget_is_split_by_a_max_length_request_and_respected():
    spec = make_spec(memory_budget_bytes=1 << 20)
    total = sum(p.nbytes for p in spec.pools)
    assert total <= spec.memory_budget_bytes
    full, win, draft = spec.pools
    live = [max_live_pages(16, w, 512, 16) for w in (None, 64, 64)]
    assert live == [33, 6, 6]
    one_request = sum(n * p.bytes_per_page for n, p in zip(live, spec.pools))
    null_pages = sum(p.bytes_per_page for p in spec.pools)
    num_requests = (spec.memory_budget_bytes - null_pages) / one_request
    assert 1 < num_requests < spec.num_slots
    assert [p.num_usable_pages for p in spec.pools] == [int(num_requests * n) for n in live]
    # Never more than every slot holding a max-length request.
    roomy = make_spec(memory_budget_bytes=1 << 30)
    assert [p.num_usable_pages for p in roomy.pools] == [spec.num_slots * n for n in live]
    # A bigger budget never shrinks a pool.
    bigger = make_spec(memory_budget_bytes=16 << 20)
    assert all(b.num_pages >= a.num_pages for a, b in zip(spec.pools, bigger.pools))


def test_max_live_pages_bounds():
    assert max_live_pages(16, None, 100, 8) == 7          # ceil(108 / 16)
    assert max_live_pages(16, 64, 10_000, 8) == 6         # ceil(71 / 16) + 1
    assert max_live_pages(16, 64, 20, 8) == 2             # short request: its full size


@pytest.mark.parametrize("field,value,match", [
    ("page_size", 0, "page_size must be a positive integer"),
    ("num_slots", -1, "num_slots must be a positive integer"),
    ("max_seq_len", 0, "max_seq_len must be a positive integer"),
    ("memory_budget_bytes", 0, "memory_budget_bytes must be a positive integer"),
    ("max_step_tokens", 0, "max_step_tokens must be a positive integer"),
    ("page_size", 24, "cannot be used by the paged kernels"),
    ("memory_budget_bytes", 1 << 16, "too small for one request"),
    ("layers", (), "layers is empty"),
])
def test_cache_spec_errors(field, value, match):
    with pytest.raises(CacheSpecError, match=match):
        make_spec(**{field: value})


@pytest.mark.parametrize("change,match", [
    (dict(num_kv_heads=0), "num_kv_heads must be a positive integer"),
    (dict(head_dim=-8), "head_dim must be a positive integer"),
    (dict(kv_dtype="fp16"), "kv_dtype='fp16' is unknown"),
    (dict(role="verifier"), "role='verifier' is unknown"),
    (dict(sliding_window=8), "smaller than page_size"),
    (dict(sliding_window=0), "sliding_window must be a positive integer"),
    (dict(k_scale=0.0), "k_scale must be a positive finite number"),
    (dict(v_scale=float("nan")), "v_scale must be a positive finite number"),
])
def test_layer_spec_errors(change, match):
    layers = list(mixed_layers())
    layers[1] = dataclasses.replace(layers[1], **change)
    with pytest.raises(CacheSpecError, match=match):
        make_spec(layers=tuple(layers))


def test_duplicate_layer_names():
    layers = mixed_layers()
    with pytest.raises(CacheSpecError, match="duplicate layer name 'target.0'"):
        make_spec(layers=layers + (layers[0],))


def test_draft_only_spec_is_a_drafters_own_cache():
    draft_only = tuple(l for l in mixed_layers() if l.role == "draft")
    spec = make_spec(layers=draft_only)
    assert [p.roles for p in spec.pools] == [frozenset({"draft"})]
    assert spec.pools[0].layer_names == tuple(l.name for l in draft_only)


def test_pools_of_one_layer_each_keep_every_pool_key_and_the_bytes_per_token():
    """size_pools over one group per layer (the per-layer-table baseline the benchmarks
    compare against)."""
    shared = make_spec()
    per_layer = size_pools(shared, tuple((layer,) for layer in shared.layers))
    assert [p.layer_names for p in per_layer] == [(l.name,) for l in shared.layers]
    for pool, layer in zip(per_layer, shared.layers):  # every layer keeps its pool key
        assert (pool.sliding_window, pool.kv_dtype) == (layer.sliding_window, layer.kv_dtype)
    per_token = lambda pools: sum(p.bytes_per_page for p in pools) / shared.page_size
    assert per_token(shared.pools) == per_token(per_layer)
    with pytest.raises(CacheSpecError, match="a pool holds layers alike"):
        size_pools(shared, (shared.layers,))


def test_bucket_width():
    assert bucket_width(0, 4096) == 128
    assert bucket_width(129, 4096) == 256
    assert bucket_width(256, 4096) == 256
    assert bucket_width(3000, 3000) == 3072  # capped at the table rounded to a block
    assert bucket_width(5, 64, block_pages=16) == 16
