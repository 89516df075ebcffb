"""A request's KV out of one cache and into another: jitted export and import steps.

    sender (context)                           receiver (generation)
    export_step(state, index: slot, logical    import_step(state, index: slot, lengths,
      pages per request)                         logical pages; payloads: first token,
      gather the row's live pages of every       drafts, buffers, checksums) per request
      pool -> one buffer per pool                allocate pages for the lengths, check the
         [H, n, L, 2, ps, D] + u32 checksums     page ranges and checksums, scatter; shared
         + the first token and the first         mode: the sender's draft block; private
           draft block its prefill made          mode: zero the draft layers -> (state, ok)
                                               redraft_step(params, state, slots), private
                                                 mode only: a draft block for every row
                                                 imported, from the drafter's own cache

In shared mode the receiver starts from exactly the draft block aggregated
serving would have (the sender's prefill computed it), so a handoff needs no
call beyond the export and the import. Requests of one page bucket
(`page_bucket`) share an export or import call, padded with rows that change
nothing (drafter/transfer_calls.py); in private mode one redraft call per step
covers its arrivals (shape: the table width). So a stream of prompts of any
length runs a few programs, all compiled before the first request
(`transfer_shapes` lists the buckets; `Engine.warmup` compiles them).

All run on the device with no host sync: the live logical pages of a row
follow from its lengths and the pool's window (`live_logical_pages`), so the
host computes them without reading the page tables. A receiver whose cache
disagrees (windows, page size) or a buffer corrupted in transit comes back
as `ok` False; the slot then does not run, and the next step's reset empties it.
A call's host inputs (slots, lengths, logical pages, resets) travel packed in
one i32 array (`transfer_calls.pack_export_index`, `pack_import_index`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from drafter.request import Request
from drafter.sampling import first_counts
from drafter.steps import StepConfig, StepState, at_precision, empty_slots, redraft_rows
from drafter.transfer_calls import call_groups, pack_export_index
from pallas_kernels.pool_layout import byte_view, from_byte_view
from unified_kv import (BAD_PAGE_INDEX, NULL_PAGE, CacheSpec, allocate_pages,
                        live_logical_pages, pow2_at_least)


def page_bucket(n: int) -> int:
    """Page counts are padded to a few sizes so export/import compile a few times:
    powers of two up to 16 pages, then 4 sizes per octave (padding <= 1/4)."""
    if n <= 16:
        return pow2_at_least(n)
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def padded_pages(logical: np.ndarray) -> np.ndarray:
    """`logical` padded with BAD entries to its bucket size."""
    out = np.full(page_bucket(len(logical)), BAD_PAGE_INDEX, np.int32)
    out[:len(logical)] = logical
    return out


def sent_pool_ids(spec: CacheSpec, mode: str) -> tuple[int, ...]:
    """Pools whose pages travel: all in shared mode; private mode keeps draft-only pools home."""
    return tuple(p.pool_id for p in spec.pools if not (mode == "private" and p.roles == {"draft"}))


def sent_logical_pages(spec: CacheSpec, pool_ids, target_len: int,
                       draft_ctx_len: int) -> tuple[np.ndarray, ...]:
    """Per pool in `pool_ids`, the live logical pages of a row of these lengths,
    BAD-padded to its page bucket: what an export gathers and an import expects."""
    return tuple(padded_pages(live_logical_pages(spec, spec.pools[i], target_len, draft_ctx_len))
                 for i in pool_ids)


def transfer_shapes(spec: CacheSpec, mode: str, lengths, *,
                    with_draft: bool) -> dict[tuple[int, ...], int]:
    """The page buckets (per sent pool) of prompts of `lengths` tokens, each with one
    length that has it: the export and import shapes a stream of those prompts runs."""
    pool_ids, out = sent_pool_ids(spec, mode), {}
    for n in lengths:
        pages = sent_logical_pages(spec, pool_ids, n, n if with_draft else 0)
        out.setdefault(tuple(len(p) for p in pages), n)
    return out


def receiver_shardings(mesh, kv_head_axis: str | None = None):
    """(the buffers' sharding: split along kv heads over `kv_head_axis`, default the
    mesh's first axis; the scalars' sharding: replicated) on the receiver's mesh, or on
    the first device when mesh is None. Arrivals are placed so, and the import's
    warm-up compiles for that placement."""
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return device, device
    return (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        kv_head_axis or mesh.axis_names[0])),
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def checksum_of(buffer: jax.Array, first_head=0) -> jax.Array:
    """Position-weighted sum of the buffer's bytes (u32): catches flips and swaps.

    A slice of kv heads [first_head, ...) sums to its share of the whole
    buffer's checksum, so the slices' checksums add up (mod 2**32) to the whole's.
    """
    heads = buffer.shape[0]
    raw = jax.lax.bitcast_convert_type(buffer, jnp.uint8).reshape(heads, -1).astype(jnp.uint32)
    m = jnp.uint32(251)
    # Byte j of global head h sits at flat position h * S + j of the whole
    # buffer (S bytes per head); its weight is that position mod 251, plus 1.
    head_w = ((jnp.arange(heads, dtype=jnp.uint32) + jnp.uint32(first_head)) % m
              * jnp.uint32(raw.shape[1] % 251)) % m
    byte_w = jnp.arange(raw.shape[1], dtype=jnp.uint32) % m
    weights = (head_w[:, None] + byte_w[None, :]) % m + jnp.uint32(1)
    return jnp.sum(raw * weights, dtype=jnp.uint32)


checksum = jax.jit(checksum_of)


def _physical(row, logical):
    """Physical pages of `logical` entries of a table row; padding -> NULL_PAGE."""
    pages = row[jnp.clip(logical, 0, row.shape[0] - 1)]
    return jnp.where(logical >= 0, pages, NULL_PAGE)


def _split(vector, sizes):
    """`vector` cut into consecutive pieces of static `sizes`."""
    out, at = [], 0
    for n in sizes:
        out.append(vector[at:at + n])
        at += n
    return out


@functools.partial(jax.jit, static_argnames=("pool_ids", "buckets"))
def export_step(state: StepState, index, *, pool_ids: tuple[int, ...],
                buckets: tuple[int, ...]):
    """Gather the live pages of each pool in `pool_ids` of each row's slot into
    contiguous buffers.

    Args:
      index: `pack_export_index` of the rows: per request its slot (the dummy slot
        gathers the null page: a row that changes nothing) and per sent pool its
        logical pages, i32[bucket] (BAD pads); `buckets`: those sizes, per pool.
    Returns:
      per row (buffers: per sent pool [H, n_bucket, L, 2, page_size, D] (padding gathers
      the all-zero null page), checksums: u32[len(pool_ids)], first token: i32[] and
      drafts: i32[block_size - 1] (the slot's anchor and draft block, which its
      prefill's last chunk set)).
    """
    # One gather and one checksum reduction a pool for every row (the call's kernels, which
    # bound its host launch time, do not grow with its rows), then each row's share.
    kv, slots = state.kv, index[:, 0]
    gathered, sums = [], []
    for i, logical in zip(pool_ids, _split(index[:, 1:].T, buckets)):      # [n, R]
        pages = jax.vmap(_physical, in_axes=(0, 1))(kv.page_tables[i][slots], logical)
        g = jnp.take(byte_view(kv.pools[i]), pages.reshape(-1), axis=1)
        g = from_byte_view(g.reshape(g.shape[0], len(slots), -1, *g.shape[2:]),
                           kv.pools[i].dtype)                               # [H, R, n, ...]
        gathered.append(g)
        sums.append(jax.vmap(checksum_of, in_axes=1)(g))
    sums, anchors, drafts = jnp.stack(sums, axis=1), state.anchors[slots], state.drafts[slots]
    return tuple((tuple(g[:, r] for g in gathered), sums[r], anchors[r], drafts[r])
                 for r in range(len(slots)))


def _pages_match(row, logical, num_pages: int):
    """The receiver's valid entries are exactly the sender's logical pages."""
    # BAD (-1) pads would wrap to the last entry: send them out of range instead.
    sent = jnp.zeros((num_pages,), bool).at[jnp.where(logical >= 0, logical, num_pages)].set(
        True, mode="drop")
    return jnp.all((row != BAD_PAGE_INDEX) == sent)


def import_step(state: StepState, index, payloads, *, cfg: StepConfig,
                pool_ids: tuple[int, ...], mode: str) -> tuple[StepState, tuple]:
    """Receive requests into empty slots: allocate, verify, scatter.

    Args:
      index: `pack_import_index`: the slots to empty first (as a step's resets: the
        import carries a step's resets when it is the step's first call), then per
        request its slot (the dummy slot: a row that changes nothing), target_len,
        draft_ctx_len and logical pages per pool in `pool_ids` (BAD pads are dropped).
      payloads: per request (first_token: i32[]; drafts: i32[block_size - 1], the
        sender's first draft block (kept in shared mode; in private mode `redraft_step`
        makes the receiver's own); buffers: per pool, as `export_step` made them, which
        give the page buckets; checksums: u32[len(pool_ids)], the sender's).
    Returns:
      (state, per row ok bool[]). With ok, the slot holds its request's KV, its anchor
      is its first token (its output counts: that token alone), its draft block is the
      sender's (shared mode), and it runs. Without, the slot does not run and holds
      pages no one writes (within its admission's reservation) until the host, reading
      ok, resets it; nothing else changed.
    """
    spec = cfg.spec
    buckets = tuple(b.shape[1] for b in payloads[0][2])
    rows = index[spec.num_slots:].reshape(len(payloads), 3 + sum(buckets))
    state = empty_slots(cfg, state, index[:spec.num_slots])
    # Every row at once (one allocation, one checksum and one scatter a pool): the call's
    # kernels, which bound its host launch time, do not grow with its rows.
    ids, target_lens, draft_ctx_lens = rows[:, 0], rows[:, 1], rows[:, 2]
    logical_pages = dict(zip(pool_ids, _split(rows[:, 3:].T, buckets)))  # pool -> [n, R]
    real = ids != spec.dummy_slot
    kv = state.kv
    kv = kv.replace(target_lens=kv.target_lens.at[ids].set(target_lens),
                    draft_ctx_lens=kv.draft_ctx_lens.at[ids].set(draft_ctx_lens))
    # Lengths first, so a windowed pool allocates only its in-window tail.
    kv, ok = allocate_pages(spec, kv, ids, target_lens, draft_ctx_lens)
    ok &= real
    for i, logical in logical_pages.items():
        ok &= jax.vmap(_pages_match, in_axes=(0, 1, None))(
            kv.page_tables[i][ids], logical, spec.pools[i].max_pages_per_seq)
    # Per sent pool, every row's buffer side by side ([H, R, n, L, 2, ps, D]): one checksum
    # reduction and one scatter a pool, however many rows the call takes.
    received = {i: jnp.stack([buffers[k] for _, _, buffers, _ in payloads], axis=1)
                for k, i in enumerate(pool_ids)}
    sent_sums = jnp.stack([sums for _, _, _, sums in payloads])      # [R, len(pool_ids)]
    ok &= jnp.all(jnp.stack([jax.vmap(checksum_of, in_axes=1)(received[i]) for i in pool_ids],
                            axis=1) == sent_sums, axis=1)
    pools = [byte_view(x) for x in kv.pools]   # moved as bytes (pool_layout.byte_view)
    for pool in spec.pools:
        i = pool.pool_id
        table_rows = kv.page_tables[i][ids]
        if i in pool_ids:
            logical = logical_pages[i].T                                   # [R, n]
            pages = jnp.where((logical >= 0) & ok[:, None],
                              jax.vmap(_physical)(table_rows, logical), pool.num_pages)
            updates = byte_view(received[i].astype(kv.pools[i].dtype))
            pools[i] = pools[i].at[:, pages.reshape(-1)].set(
                updates.reshape(updates.shape[0], -1, *updates.shape[3:]), mode="drop")
        draft_offsets = [o for o, name in enumerate(pool.layer_names)
                         if spec.layer(name).role == "draft"]
        if mode == "private" and draft_offsets:  # the drafter starts without the prompt
            pages = jnp.where((table_rows != BAD_PAGE_INDEX) & ok[:, None], table_rows,
                              pool.num_pages).reshape(-1)
            for o in draft_offsets:
                pools[i] = pools[i].at[:, pages, o].set(0, mode="drop")
    # A failed row keeps its pages, not running, until the host reads its ok and resets
    # the slot (as for any ended request): a release here added a fifth to the program.
    kv = kv.replace(pools=tuple(from_byte_view(x, old.dtype) for x, old in zip(pools, kv.pools)))
    firsts = jnp.stack([first for first, _, _, _ in payloads])
    drafts = state.drafts
    if mode == "shared":  # private mode: redraft_step drafts the slot
        sent = jnp.stack([d for _, d, _, _ in payloads])
        drafts = drafts.at[ids].set(jnp.where(ok[:, None], sent, drafts[ids]))
    state = state.replace(kv=kv, drafts=drafts, anchors=state.anchors.at[ids].set(
                              jnp.where(ok, firsts, state.anchors[ids])),
                          running=state.running.at[ids].set(ok | state.running[ids] & ~real),
                          output_counts=first_counts(state.output_counts, ids, firsts, ok))
    return state, tuple(ok)


@at_precision
def redraft_step(params, state: StepState, slots, *, cfg: StepConfig,
                 table_width: int) -> StepState:
    """A fresh draft block for each of `slots` (i32[num_slots], dummy pads) that runs:
    the rows a step's imports brought in (a failed import's slot does not run)."""
    active = (slots != cfg.spec.dummy_slot) & state.running[slots]
    return redraft_rows(params, state, slots, cfg=cfg, table_width=table_width, active=active)


@dataclasses.dataclass
class KVPayload:
    """One request's KV as it travels: what `import_step` takes.

    Attributes:
      target_len, draft_ctx_len: the sender's lengths (the prompt's).
      first_token: the token after the prompt (i32[] on a device, or an int).
      drafts: the first draft block the sender's prefill made (i32[block_size - 1], on
        a device or numpy).
      pool_ids: the pools sent (`sent_pool_ids`); logical_pages: per pool,
        i32[n_bucket] BAD-padded; buffers: per pool [H, n_bucket, L, 2, ps, D];
        checksums: u32[len(pool_ids)] (a device array or numpy).
      mode: "shared" or "private".
      origin: who sent it, as errors about it name the sender ("" : unnamed).
      first_logprobs: when the request asked for log-probabilities, its first token's
        `sampling.token_logprobs` row as i32 bits (i32[LOGPROB_WIDTH], on a device or
        numpy: the sender's prefill computed it); else None.
      prompt_logprobs: when the request asked for its prompt's, per prefill chunk (i32
        bits [rows x LOGPROB_WIDTH] or more, on a device or numpy; the rows that are its
        prompt tokens', in order); else ().
    """

    target_len: int
    draft_ctx_len: int
    first_token: object
    drafts: object
    pool_ids: tuple[int, ...]
    logical_pages: tuple[np.ndarray, ...]
    buffers: tuple[jax.Array, ...]
    checksums: object
    mode: str
    origin: str = ""
    first_logprobs: object = None
    prompt_logprobs: tuple = ()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def export_payloads(spec: CacheSpec, state: StepState, rows, *, mode: str,
                    export=export_step, rows_per_call: int = 1) -> list[KVPayload]:
    """Dispatch `export` (`export_step`, or it placed on a mesh) for prefilled slots
    (no host sync), grouped by `call_groups`. rows: (slot, target_len, draft_ctx_len)
    per request; payloads in their order."""
    pool_ids, out = sent_pool_ids(spec, mode), [None] * len(rows)
    logicals = [sent_logical_pages(spec, pool_ids, t, d) for _, t, d in rows]
    keys = [tuple(len(p) for p in logical) for logical in logicals]
    for key, idx, padded in call_groups(keys, rows_per_call):
        pad = (spec.dummy_slot, tuple(np.full(n, BAD_PAGE_INDEX, np.int32) for n in key))
        args = [(rows[i][0], logicals[i]) for i in idx]
        index = pack_export_index(args + [pad] * (padded - len(idx)))
        got = export(state, index, pool_ids=pool_ids, buckets=key)
        for i, (buffers, sums, first, drafts) in zip(idx, got):
            _, t, d = rows[i]
            out[i] = KVPayload(t, d, first, drafts, pool_ids, logicals[i], buffers, sums, mode)
    return out


# ---------------------------------------------------------------- between engines

class KVSource(Protocol):
    """Where a generation engine's admitted requests get their KV. A source whose
    senders' steps run in this process may also have `warmup(max_len, min_len, *,
    sampled, logprobs, adjusted)`, which `Engine.warmup` calls to compile those steps too;
    one whose senders are other processes may also have `unavailable() -> str | None`
    (why a request sent now would fail: a peer unreachable or silent), which
    `Engine.kv_source_unavailable` asks."""

    def fetch(self, request: Request) -> None:
        """Start producing `request`'s KV (it is admitted here: room is reserved)."""

    def poll(self, timeout: float) -> list[tuple[str, KVPayload | BaseException | None]]:
        """Arrived payloads (on this engine's devices) or failures, by request id;
        waits up to `timeout` seconds for the first one. None: the request's KV
        is still being made (its `kv_timeout_s` starts again)."""


@dataclasses.dataclass
class Export:
    """A context engine's prefilled request, leaving with its KV."""

    request: Request
    payload: KVPayload
    submitted: float


def import_failure(request_id: str, origin: str = "") -> str:
    """The error of a request whose import step said not ok."""
    sender = f" from {origin}" if origin else ""
    return (f"request {request_id!r}: KV import{sender} failed: a buffer's checksum or its "
            f"page ranges did not match (corrupted in transit, or the two caches disagree "
            f"on windows or page size); retry the request, and if it recurs check that "
            f"link and both workers' cache settings")


def import_refusal(payload: KVPayload, spec: CacheSpec, mode: str, prompt_len: int,
                   num_drafts: int) -> str | None:
    """Why a worker of `spec` in draft-KV `mode`, drafting `num_drafts` tokens a block,
    cannot import `payload` for a prompt of `prompt_len` tokens (None: it can). Checked
    on the host before the import step."""
    want = sent_pool_ids(spec, mode)
    if payload.mode != mode or tuple(payload.pool_ids) != want:
        return (f"the sender's draft KV mode {payload.mode!r} (pools "
                f"{list(payload.pool_ids)}) differs from this worker's {mode!r} "
                f"(pools {list(want)}); start both with the same mode")
    if payload.target_len != prompt_len:
        return f"the sender prefilled {payload.target_len} tokens, the prompt has {prompt_len}"
    if mode == "shared" and tuple(np.shape(payload.drafts)) != (num_drafts,):
        return (f"the sender's first draft block has shape {list(np.shape(payload.drafts))}, "
                f"this worker drafts {num_drafts} tokens a block; serve both with the same "
                f"drafter")
    return None
