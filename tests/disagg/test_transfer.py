"""Transfer pieces: move paths, the head-additive checksum, head slices, page buckets."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disagg.transfer import (MOVE_PATHS, Handoff, MovePathUnavailable, TransferError,
                             assemble_heads, move_buffer, pinned_host_sharding, split_heads)
from drafter.kv_io import KVPayload, checksum, page_bucket as _bucket
from drafter.request import Request


def kv_buffer(heads=4, pages=3, dtype=jnp.bfloat16, seed=0):
    return jax.random.normal(jax.random.key(seed), (heads, pages, 2, 2, 8, 16)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32])
def test_checksum_of_head_slices_adds_up_to_the_whole(dtype):
    buf = kv_buffer(dtype=dtype)
    whole = int(checksum(buf))
    parts = sum(int(checksum(buf[a:b], a)) for a, b in ((0, 1), (1, 3), (3, 4)))
    assert parts & 0xFFFFFFFF == whole
    assert int(checksum(buf[1:3], 0)) != int(checksum(buf[1:3], 1))  # the offset matters


def test_checksum_catches_a_flip_and_a_head_swap():
    buf = kv_buffer()
    whole = int(checksum(buf))
    assert int(checksum(buf.at[2, 1, 0, 1, 3, 5].add(1.0))) != whole
    assert int(checksum(buf[jnp.array([1, 0, 2, 3])])) != whole


def test_page_buckets_pad_little_and_compile_few_sizes():
    sizes = set()
    for n in range(1, 5000):
        b = _bucket(n)
        assert b >= n and (n <= 16 or b <= n * 1.25), (n, b)
        sizes.add(b)
    assert [_bucket(n) for n in (1, 3, 5, 9, 16, 17, 33)] == [1, 4, 8, 16, 16, 20, 40]
    assert len(sizes) <= 5 + 4 * 9  # powers of two to 16, then 4 per octave


@pytest.mark.parametrize("path", MOVE_PATHS)
def test_every_move_path_moves_bytes_intact_between_devices(path):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 (host) devices")
    src, dst = jax.devices()[:2]
    buf = jax.device_put(kv_buffer(), src)
    moved = move_buffer(buf, jax.sharding.SingleDeviceSharding(dst), path)
    assert moved.devices() == {dst} and moved.sharding.memory_kind in (None, "device")
    np.testing.assert_array_equal(np.asarray(moved, np.float32), np.asarray(buf, np.float32))


def test_pinned_host_stages_in_pinned_memory():
    sharding = pinned_host_sharding(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    staged = jax.device_put(kv_buffer(), sharding)
    assert staged.sharding.memory_kind == "pinned_host"


def test_pinned_host_on_devices_without_it_names_the_alternative():
    memories = [types.SimpleNamespace(kind="device"), types.SimpleNamespace(kind="unpinned_host")]
    device = types.SimpleNamespace(addressable_memories=lambda: memories)
    sharding = types.SimpleNamespace(device_set=[device])
    with pytest.raises(MovePathUnavailable,
                       match=r"needs pinned host memory.*\['device', 'unpinned_host'\].*'host'"):
        pinned_host_sharding(sharding)


def test_unknown_move_path_is_named():
    with pytest.raises(ValueError, match="move path 'carrier-pigeon' is unknown"):
        move_buffer(kv_buffer(), jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                    "carrier-pigeon")


def handoff_of(buf):
    pages = np.arange(buf.shape[1], dtype=np.int32)
    payload = KVPayload(target_len=2, draft_ctx_len=2, first_token=np.int32(3),
                        drafts=np.zeros(7, np.int32), pool_ids=(0,),
                        logical_pages=(pages,), buffers=(buf,),
                        checksums=np.asarray([checksum(buf)], np.uint32), mode="shared")
    return Handoff(Request("r0", (1, 2)), payload, kv_format=None)


def tp_buffer(tp):
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} (host) devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))
    return jax.device_put(kv_buffer(), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("tp")))


def test_split_then_assemble_gives_back_the_buffer_and_its_checksum():
    buf = tp_buffer(4)
    whole = handoff_of(buf)
    slices = split_heads(whole)
    assert [s.heads[0] for s in slices] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert all(len(s.payload.buffers[0].devices()) == 1 for s in slices)
    joined = assemble_heads(slices[::-1], jax.devices()[3])  # any arrival order
    assert joined.num_slices == 1
    assert np.asarray(joined.payload.checksums).tolist() == \
        np.asarray(whole.payload.checksums).tolist()
    assert joined.payload.buffers[0].devices() == {jax.devices()[3]}
    np.testing.assert_array_equal(np.asarray(joined.payload.buffers[0], np.float32),
                                  np.asarray(buf, np.float32))


def test_assemble_names_a_missing_or_repeated_slice():
    slices = split_heads(handoff_of(tp_buffer(2)))
    with pytest.raises(TransferError, match=r"head slices \[0\] arrived, expected 0..1"):
        assemble_heads(slices[:1], jax.devices()[0])
    with pytest.raises(TransferError, match=r"head slices \[1, 1\] arrived"):
        assemble_heads([slices[1], slices[1]], jax.devices()[0])
    bad = dataclasses.replace(slices[1], heads=((0, 1),))
    with pytest.raises(TransferError, match="kv heads 1..-1 are missing or repeated"):
        assemble_heads([slices[0], bad], jax.devices()[0])


def test_a_corrupted_slice_fails_the_joined_checksum():
    slices = split_heads(handoff_of(tp_buffer(2)))
    buf = slices[1].payload.buffers[0]
    slices[1] = dataclasses.replace(slices[1], payload=dataclasses.replace(
        slices[1].payload, buffers=(buf.at[0, 0, 0, 0, 0, 0].add(1.0),)))
    joined = assemble_heads(slices, jax.devices()[0])
    assert int(checksum(joined.payload.buffers[0])) != int(joined.payload.checksums[0])
