import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine.chunks.chunk import Tier
from lightning_chunk.engine.chunks.packing import build_layout
from lightning_chunk.engine.chunks.states import TensorState as S
from lightning_chunk.engine.config import ChunkConfig, DtypePolicy
from lightning_chunk.engine.errors import DeviceMemoryLimitError
from lightning_chunk.engine.memory.consolidate import full_values, unpack
from lightning_chunk.engine.memory.manager import ChunkManager


def make(limit=None, dtypes=None, tiers=None, capacity=72):
    dtypes = dtypes or DtypePolicy()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 2))
    named = list(net.named_parameters())
    originals = [p.detach().clone() for _, p in named]
    mgr = ChunkManager(
        named,
        {i: 0 for i in range(len(named))},
        config=ChunkConfig(device_memory_limit=limit),
        dtypes=dtypes,
        device=torch.device("cpu"),
    )
    checks = []
    mgr.on_change = lambda: (mgr.check_accounting(), checks.append(1))
    layout = build_layout(mgr.specs, list(range(len(named))), capacity, 1)
    mgr.pack(layout, tiers or {c.chunk_id: Tier.HOST for c in layout.chunks})
    return net, mgr, originals, checks


def test_pack_keeps_identity_and_values_and_frees_host_payloads():
    net, mgr, originals, checks = make()
    params = list(net.parameters())
    assert [p is q for p, q in zip(params, mgr.params, strict=True)] == [True] * len(params)
    # 40 and 32 elements do not share a 72-element chunk (the second starts at 48: [Note: aligned parameters]);
    # 36, 8 and 2 do (at 0, 48 and 64)
    assert len(mgr.chunks) == 2 and checks
    assert [s.offset for c in mgr.layout.chunks for s in c.slots] == [0, 32, 0, 32, 48, 64]
    for c in mgr.chunks:
        assert not c.is_resident and c.payload.untyped_storage().nbytes() == 0
    values = full_values(mgr)
    for i, orig in enumerate(originals):
        torch.testing.assert_close(values[i], orig, rtol=0, atol=0)


def test_gather_release_roundtrip_and_accounting_after_every_operation():
    net, mgr, originals, checks = make()
    c = mgr.chunks[0]
    before = len(checks)
    mgr.gather(c)
    assert c.is_resident and all(t.state is S.HOLD for t in c.tensors)
    assert mgr.ledger[Tier.DEVICE] == c.payload_bytes
    torch.testing.assert_close(net[0].weight.detach(), originals[0], rtol=0, atol=0)
    mgr.release(c)
    assert not c.is_resident and mgr.ledger[Tier.DEVICE] == 0 and mgr.transfers.evictions == 1
    assert len(checks) > before  # the invariant was re-derived after each operation
    assert mgr.ledger.peak == c.payload_bytes


def test_release_refuses_a_chunk_in_use():
    net, mgr, *_ = make()
    c = mgr.chunks[0]
    mgr.gather(c)
    c.set_state(c.tensors[0], S.COMPUTE)
    with pytest.raises(AssertionError, match="in use"):
        mgr.release(c)


def test_device_limit_is_never_exceeded():
    net, mgr, *_ = make(limit=72 * 4 + 10)
    mgr.gather(mgr.chunks[0])
    with pytest.raises(DeviceMemoryLimitError, match="device_memory_limit=298 bytes would be exceeded"):
        mgr.gather(mgr.chunks[1])
    assert mgr.ledger[Tier.DEVICE] <= 298 and not mgr.chunks[1].is_resident


def test_device_tier_aliases_payload_in_fp32_and_keeps_separate_master_in_bf16():
    net, mgr, originals, _ = make(tiers={0: Tier.DEVICE, 1: Tier.DEVICE, 2: Tier.DEVICE})
    c = mgr.chunks[0]
    assert c.aliased and c.is_resident and c.master is None  # the payload is the master
    assert mgr.ledger[Tier.DEVICE] == sum(mgr.device_shard_bytes(c) for c in mgr.chunks)
    net, mgr, originals, _ = make(
        dtypes=DtypePolicy(torch.bfloat16, torch.float32), tiers={0: Tier.DEVICE, 1: Tier.HOST, 2: Tier.HOST}
    )
    assert mgr.chunks[0].master.dtype == torch.float32 and net[0].weight.dtype == torch.bfloat16
    assert mgr.chunks[1].low.dtype == torch.bfloat16 and mgr.ledger[Tier.HOST] > 0


def test_gradients_accumulate_and_the_chunk_reduces_when_complete():
    net, mgr, *_ = make()
    p = net[1].weight
    chunk, info = mgr.lookup(p)
    assert {t.name for t in chunk.tensors} == {"1.weight", "1.bias", "2.weight", "2.bias"}
    mgr.gather(chunk)
    chunk.transition_all(S.COMPUTE)
    mgr.grads.accumulate(p, torch.ones_like(p))
    with pytest.raises(Exception, match="READY_FOR_REDUCE -> READY_FOR_REDUCE"):
        mgr.grads.accumulate(p, torch.ones_like(p))  # twice in one backward: a hook-order bug
    mgr.grads.accumulate(net[1].bias, torch.ones_like(net[1].bias))
    assert info.state is S.READY_FOR_REDUCE and not chunk.is_evictable  # waits for net[2]
    mgr.grads.accumulate(net[2].weight, torch.ones_like(net[2].weight))
    mgr.grads.accumulate(net[2].bias, torch.ones_like(net[2].bias))
    assert all(t.state is S.HOLD_AFTER_BWD for t in chunk.tensors) and chunk.is_evictable
    mgr.reset_states()  # the next micro-batch adds to what the first left
    chunk.transition_all(S.COMPUTE)
    mgr.grads.accumulate(p, torch.ones_like(p))
    mgr.grads.end_backward()  # net[1].bias and net[2] got no gradient this time: reduced at the end of backward
    assert all(t.state is S.HOLD_AFTER_BWD for t in chunk.tensors)
    idx = mgr.index_of[id(p)]
    torch.testing.assert_close(mgr.grads.view(idx), torch.full((p.numel(),), 2.0))
    mgr.grads.clear()
    assert mgr.grads.view(idx) is None
    mgr.reset_states()
    chunk.transition_all(S.COMPUTE)
    mgr.grads.accumulate(p, torch.ones_like(p))  # the next step overwrites, it does not add to stale values
    torch.testing.assert_close(mgr.grads.view(idx), torch.ones(p.numel()))


def test_a_chunk_waiting_to_reduce_gives_its_payload_up_only_when_asked_and_keeps_its_gradients():
    """[Note: a gradient waits without its payload]: the waiting gradients live in their own buffer, so the payload
    may go; a gather brings the waiting tensors back to READY_FOR_REDUCE, and the reduce finishes them."""
    net, mgr, originals, checks = make()
    chunk, _ = mgr.lookup(net[1].weight)
    mgr.gather(chunk)
    chunk.transition_all(S.COMPUTE)
    mgr.grads.accumulate(net[1].weight, torch.full_like(net[1].weight, 3.0))
    assert not chunk.waits_only_to_reduce  # the rest of the chunk is still in use
    for t in chunk.tensors:
        if t.state is S.COMPUTE:
            chunk.set_state(t, S.HOLD_AFTER_FWD)  # its module's forward is done, backward still ahead
    assert not chunk.is_evictable and chunk.waits_only_to_reduce
    with pytest.raises(AssertionError, match="in use"):
        mgr.release(chunk)  # a plain eviction never takes it
    mgr.release(chunk, waiting_grads=True)
    assert not chunk.is_resident and mgr.ledger[Tier.DEVICE] == 0
    assert {t.name: t.state for t in chunk.tensors} == {
        "1.weight": S.READY_FOR_REDUCE_FREE,
        "1.bias": S.FREE,
        "2.weight": S.FREE,
        "2.bias": S.FREE,
    }
    assert not chunk.grads_complete() and chunk.has_waiting_grads()
    mgr.gather(chunk)  # backward comes back to the chunk's other tensors
    assert chunk.states()["1.weight"] is S.READY_FOR_REDUCE and chunk.states()["1.bias"] is S.HOLD
    torch.testing.assert_close(net[2].weight.detach(), originals[4], rtol=0, atol=0)
    mgr.release(chunk, waiting_grads=True)
    mgr.grads.end_backward()  # the others got no gradient: reduced at the end, with the payload gone
    assert all(t.state is S.FREE for t in chunk.tensors) and not chunk.is_resident
    idx = mgr.index_of[id(net[1].weight)]
    torch.testing.assert_close(mgr.grads.view(idx), torch.full((net[1].weight.numel(),), 3.0))
    assert checks  # the accounting was re-derived after every operation


def test_repack_moves_values_and_gradients():
    net, mgr, originals, _ = make()
    p = net[2].weight
    chunk, _ = mgr.lookup(p)
    mgr.gather(chunk)
    chunk.transition_all(S.COMPUTE)
    mgr.grads.accumulate(p, torch.full_like(p, 3.0))
    new = build_layout(mgr.specs, [4, 5, 2, 3, 0, 1], 200, 1)
    mgr.pack(new, {c.chunk_id: Tier.DEVICE for c in new.chunks})
    assert len(mgr.chunks) == 1 and mgr.chunks[0].aliased
    values = full_values(mgr)
    for i, orig in enumerate(originals):
        torch.testing.assert_close(values[i], orig, rtol=0, atol=0)
    torch.testing.assert_close(mgr.grads.view(4), torch.full((8,), 3.0))
    assert mgr.grads.view(0) is None


def test_unpack_materializes_plain_parameters():
    net, mgr, originals, _ = make()
    unpack(mgr, materialize=True)
    assert [mgr.ledger[t] for t in Tier] == [0, 0, 0]
    for p, orig in zip(net.parameters(), originals, strict=True):
        torch.testing.assert_close(p.detach(), orig, rtol=0, atol=0)
        assert p.untyped_storage().nbytes() == p.numel() * 4


def test_unpack_streams_one_chunk_at_a_time():
    """Each chunk's shards are dropped before the next is gathered: the model plus one chunk, not every shard too."""
    net, mgr, originals, _ = make()
    events = []
    gather, drop = mgr.gather_shard, mgr.drop
    mgr.gather_shard = lambda c, s: (events.append(("gather", c.chunk_id)), gather(c, s))[1]
    mgr.drop = lambda c: (events.append(("drop", c.chunk_id)), drop(c))[1]
    unpack(mgr, materialize=True)
    assert events == [("gather", 0), ("drop", 0), ("gather", 1), ("drop", 1)]
    for p, orig in zip(net.parameters(), originals, strict=True):
        torch.testing.assert_close(p.detach(), orig, rtol=0, atol=0)


def test_building_a_chunk_reserves_the_payload_it_allocates_for_the_views():
    """The payload is allocated to make the parameter views, then released: that allocation counts too."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    named = list(net.named_parameters())
    mgr = ChunkManager(
        named,
        {i: 0 for i in range(len(named))},
        config=ChunkConfig(device_memory_limit=100),
        dtypes=DtypePolicy(),
        device=torch.device("cpu"),
    )
    layout = build_layout(mgr.specs, list(range(len(named))), 64, 1)
    with pytest.raises(DeviceMemoryLimitError, match="building chunk 0 needs 256 more bytes"):
        mgr.pack(layout, {c.chunk_id: Tier.HOST for c in layout.chunks})


def test_grad_offload_without_a_side_stream_copies_and_adds_at_once():
    from lightning_chunk.engine.tiers.offload import GradOffload

    off = GradOffload(torch.device("cpu"), pinned=True)
    assert not off.asynchronous
    dst, done = torch.zeros(4), []
    off.copy(dst, torch.ones(2, 2), add=False, on_done=lambda: done.append(1))
    off.copy(dst, torch.full((4,), 2.0, dtype=torch.bfloat16), add=True)
    assert len(off) == 0 and done == [1]
    torch.testing.assert_close(dst, torch.full((4,), 3.0))


def test_the_host_s_waits_for_gradient_copies_are_charged_to_tier_copy():
    """[Note: where a step's time goes] on CUDA: a drain that waits for a copy to land is ``tier_copy`` (the end of
    backward drains them all), played here with events that take 50 and 500 ms to land."""
    import time

    from lightning_chunk.engine.system.timing import StepClock
    from lightning_chunk.engine.tiers.offload import GradOffload, _Copy

    class Landing:
        def __init__(self, s):
            self.s = s

        def synchronize(self):
            time.sleep(self.s)

    off, dst = GradOffload(torch.device("cpu"), pinned=False), torch.zeros(4)
    off.clock = StepClock()
    off._queue.extend(_Copy(Landing(s), dst, None, False, None) for s in (0.05, 0.5))  # type: ignore[arg-type]
    off.drain(keep=1)  # the older copy only
    assert len(off) == 1 and 0.05 <= off.clock.seconds["tier_copy"] < 0.5
    off.drain()
    assert off.clock.seconds["tier_copy"] >= 0.55


def test_disk_shards_live_in_files_and_page_out_after_use(tmp_path):
    """A chunk on the disk tier: master, gradient and optimizer state are views of mapped files (the ledger counts
    them on the disk tier, a bf16 compute copy on the host), a use pages them in and out, state kept in the file
    is laid out like the master shard, and closing removes the scratch directory."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    named = list(net.named_parameters())
    mgr = ChunkManager(
        named,
        {i: 0 for i in range(len(named))},
        config=ChunkConfig(disk_dir=str(tmp_path)),
        dtypes=DtypePolicy(torch.bfloat16, torch.float32),
        device=torch.device("cpu"),
    )
    layout = build_layout(mgr.specs, list(range(len(named))), 4160, 1)
    values = [p.detach().clone() for _, p in named]
    mgr.pack(layout, {0: Tier.DISK, 1: Tier.HOST})
    mgr.reserve_optimizer_state({0: 8})
    c = mgr.chunks[0]
    assert mgr.ledger[Tier.DISK] == c.shard_numel * (4 + 4 + 8)  # master, gradient, Adam's moments
    assert mgr.ledger[Tier.HOST] >= c.shard_numel * 2  # the bf16 copy gathers read
    mgr.check_accounting()
    storage = mgr.tiers.disk
    files = storage.record(c).files
    assert set(files) == {"master", "grad", "optim"} and all(f.path.parent.parent == tmp_path for f in files.values())
    for t in c.tensors:  # the master holds the values the chunk was built from
        torch.testing.assert_close(c.master[t.offset : t.offset + t.numel], values[t.slot.param_index].reshape(-1))
    view = c.master[64:128]
    moment = torch.arange(64, dtype=torch.float32)
    kept = mgr.tiers.keep_state(c, view, "exp_avg", moment)
    assert kept is not moment and torch.equal(kept, moment)
    region = mgr.tiers.state_region(c, "exp_avg")
    assert torch.equal(region[64:128], moment) and region[:64].abs().sum() == 0
    with storage.writing(c):
        c.master.add_(1)
    with storage.reading(c, ("master",)):
        assert c.master[0] == values[0].reshape(-1)[0] + 1  # written, paged out, read back from the file
    assert storage.io.read_bytes > 0 and storage.io.write_bytes > 0
    unpack(mgr, materialize=True)
    mgr.close()
    assert list(tmp_path.iterdir()) == []
    torch.testing.assert_close(net[0].weight, values[0] + 1)


def test_a_gradient_payload_that_does_not_fit_while_accumulating_unsharded_names_the_setting():
    """Inside ``no_sync`` (``sharded_accumulation=False``) every chunk's whole gradient stays on the device until the
    stepping micro-batch: a limit that holds the step but not that is told apart, with the way out."""
    from types import SimpleNamespace

    from lightning_chunk.engine.comm.reduce import GradReducer

    class NoRoom:
        def room_for(self, chunk, what, make_room=None):
            raise DeviceMemoryLimitError(f"{what} needs {chunk.grad_payload_bytes} more bytes")

    class Full:  # a device tier with no room left
        device = torch.device("cpu")
        grads = NoRoom()
        clock = None

    chunk = SimpleNamespace(grad_payload=None, capacity_numel=10, grad_payload_dtype=torch.float32, chunk_id=3)
    chunk.grad_payload_bytes = 40
    reducer = GradReducer(Full(), pinned=False)
    with pytest.raises(DeviceMemoryLimitError) as synced:
        reducer._ensure_payload(chunk, None)
    reducer.sync = False
    with pytest.raises(DeviceMemoryLimitError) as unsynced:
        reducer._ensure_payload(chunk, None)
    assert "sharded_accumulation" not in str(synced.value)
    assert str(unsynced.value).startswith("chunk 3's gradient payload (accumulating with sharded_accumulation=False")
    assert "sharded_accumulation=True keeps only this rank's shard" in str(unsynced.value)
    assert str(unsynced.value).endswith("needs 40 more bytes")


def test_the_warm_up_subtracts_only_the_optimizer_state_that_exists():
    """[Note: optimizer state the warm-up does not see]: with shards on the device the ledger reserves Adam's state at
    set-up, but Adam makes it at its first step; the tracer's chunk bytes (subtracted from what CUDA has allocated)
    leave it out until then."""
    import torch

    from lightning_chunk.engine import ChunkConfig, ChunkEngine
    from lightning_chunk.engine.chunks.chunk import Tier
    from tests.engine_steps import step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    eng = ChunkEngine(
        model, [opt], config=ChunkConfig(placement="device", chunk_numel=4096), device=torch.device("cpu")
    )
    mgr = eng.manager
    state = sum(c.optim_state_bytes for c in mgr.chunks if c.shard_tier is Tier.DEVICE)
    assert state > 0
    assert eng.hooks.tracer._chunk_device_bytes() == mgr.ledger[Tier.DEVICE] - state
    step(eng, model, opt, torch.randn(4, 64))
    assert eng.hooks.tracer._chunk_device_bytes() == mgr.ledger[Tier.DEVICE]


@pytest.mark.parametrize("room", [1 << 40, 1000])
def test_the_model_is_built_after_fit_only_where_it_fits(monkeypatch, room):
    """[Note: the model after fit]: by default the teardown gives the parameters their whole values where the whole
    model fits in the rank's host memory; elsewhere it leaves them empty and says so (13B in fp32 on every rank of
    an 8-GPU node is 416 GB: the out-of-memory killer at the end of a finished run)."""
    import warnings

    import torch

    import lightning_chunk.engine.runtime.engine as runtime
    from lightning_chunk.engine import ChunkConfig, ChunkEngine

    monkeypatch.setattr(runtime, "page_cache_room", lambda: room)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    eng = ChunkEngine(model, [], config=ChunkConfig(chunk_numel=4096), device=torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng.teardown(materialize=None)
    said = [str(w.message) for w in caught if "left empty" in str(w.message)]
    if room > 1 << 30:
        assert not said
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), k
    else:
        assert said and "does not fit" in said[0] and "consolidate" in said[0]
        assert all(p.numel() == 0 for p in model.parameters())


class _OtherRankHasItInUse:
    """Two ranks' collectives, seen from rank 0, where the other rank has every chunk in use."""

    world_size = 2

    def tensor_device(self):
        return torch.device("cpu")

    def all_reduce(self, t, op, *, what):
        assert op == "min"
        return t.zero_()


@pytest.mark.parametrize("other_rank_waits", [True, False])
def test_the_last_resort_releases_a_waiting_chunk_only_where_it_waits_on_every_rank(monkeypatch, other_rank_waits):
    """[Note: gradients some ranks lack]: a chunk waits to reduce on the rank its gradient reached and is in use on
    one it did not; the last resort may release it on neither, or the ranks' device bytes part."""
    from lightning_chunk.engine.runtime.moments import MomentClock

    net, mgr, _, _ = make(limit=1024)
    chunk, _ = mgr.lookup(net[1].weight)
    mgr.gather(chunk)
    chunk.transition_all(S.COMPUTE)
    mgr.grads.accumulate(net[1].weight, torch.ones_like(net[1].weight))
    for t in chunk.tensors:
        if t.state is S.COMPUTE:
            chunk.set_state(t, S.HOLD_AFTER_FWD)
    assert chunk.waits_only_to_reduce
    clock = MomentClock.__new__(MomentClock)
    clock.manager, clock.trace, clock.training, clock.position = mgr, None, True, 0
    if not other_rank_waits:
        monkeypatch.setattr(mgr, "comm", _OtherRankHasItInUse())
    clock.release_waiting(1024, keep=())
    assert chunk.is_resident is not other_rank_waits


def test_a_gradient_payload_with_nothing_left_to_evict_names_the_smallest_limit_for_that_moment(monkeypatch):
    """A limit too small for the warm-up's backward used to end on "would be exceeded" alone; the user is told what
    this moment needs and the ways out: a smaller chunk only where the user chose the size, and the placement where
    its shards on the device take the room ([Note: the shards a placement keeps on the device])."""
    net, mgr, _, _ = make(limit=300)
    chunk, _ = mgr.lookup(net[1].weight)
    mgr.gather(chunk)
    chunk.transition_all(S.COMPUTE)  # in use: nothing to evict
    held = mgr.ledger[Tier.DEVICE]
    payload = chunk.capacity_numel * 4  # fp32 gradients
    with pytest.raises(DeviceMemoryLimitError, match="would be exceeded") as bare:
        mgr.grads.room_for(chunk, "chunk 0's gradient payload")  # no policy to evict by (set-up): the bare message
    assert "Nothing else could be evicted" not in str(bare.value)
    with pytest.raises(DeviceMemoryLimitError) as told:
        mgr.grads.room_for(chunk, "chunk 0's gradient payload", make_room=lambda n: None)
    assert f"need {held + payload} bytes" in str(told.value)
    assert "raise device_memory_limit above that" in str(told.value) and "chunk_numel" not in str(told.value)
    mgr.config = mgr.config.replace(chunk_numel=72, placement="static")
    with pytest.raises(DeviceMemoryLimitError) as told:
        mgr.grads.room_for(chunk, "chunk 0's gradient payload", make_room=lambda n: None)
    assert "lower chunk_numel" in str(told.value) and "offload_fraction" not in str(told.value)
    assert "no trace yet" not in str(told.value)  # one rank: each gradient goes to the shard as it comes

    # several ranks, no trace yet: a payload stays until the chunk is complete on every rank, so the ones to come
    # are named too ([Note: gradient payloads before the trace] in memory/grads.py)
    monkeypatch.setattr(mgr, "comm", _OtherRankHasItInUse())
    to_come = sum(c.capacity_numel * 4 for c in mgr.chunks if c is not chunk)
    with pytest.raises(DeviceMemoryLimitError) as told:
        mgr.grads.room_for(chunk, "chunk 0's gradient payload", make_room=lambda n: None)
    assert f"with the payloads of {len(mgr.chunks) - 1} more chunk(s) still to come" in str(told.value)
    assert f"a limit of {held + payload + to_come} bytes" in str(told.value)

    net, mgr, _, _ = make(limit=1000, tiers={0: Tier.HOST, 1: Tier.DEVICE})
    chunk, _ = mgr.lookup(net[0].weight)
    mgr.gather(chunk)
    chunk.transition_all(S.COMPUTE)
    mgr.config = mgr.config.replace(placement="static")
    shards = mgr.device_shard_bytes(mgr.chunks[1])
    with pytest.raises(DeviceMemoryLimitError) as told:
        mgr.grads.room_for(chunk, "chunk 0's gradient payload", make_room=lambda n: None)
    assert f"{shards} bytes of shards placement='static' keeps on the device" in str(told.value)
    assert "raise offload_fraction (static)" in str(told.value)
