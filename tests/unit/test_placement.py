import random

import pytest

from lightning_chunk.engine.chunks.chunk import Tier
from lightning_chunk.engine.config import ChunkConfig
from lightning_chunk.engine.schedule.placement import (
    AutoPlacement,
    ChunkView,
    HostPlacement,
    StaticPlacement,
    smallest_working_limit,
    working_set_bytes,
)
from lightning_chunk.engine.schedule.tracer import BACKWARD, FORWARD, POST_FORWARD, Moment, Trace


def fake_trace():
    """Forward over chunks 0,1,2,3 then backward 3,2,1,0, with activations growing then shrinking."""
    ms = []
    for i, c in enumerate([0, 1, 2, 3]):
        ms.append(Moment(FORWARD, f"m{c}", (c,), (c,), 100 * i))
        ms.append(Moment(POST_FORWARD, f"m{c}", (c,), (c,), 100 * i + 50))
    for i, c in enumerate([3, 2, 1, 0]):
        ms.append(Moment(BACKWARD, f"m{c}", (c,), (c,), 300 - 100 * i))
    return Trace(tuple(ms))


def view(cid, resident=False, evictable=None, tier=Tier.HOST, last=-1, payload=1000, shard=4000):
    return ChunkView(cid, payload, shard, resident, resident if evictable is None else evictable, tier, last)


def test_trace_queries():
    t = fake_trace()
    assert t.nonmodel_peak_bytes == 350
    assert t.next_chunks(0) == (1,)  # skips the post-forward moment
    assert t.next_use(0, 0) == 11  # chunk 0 next used at position 11 (its backward)
    assert t.next_use(3, 8) == 12 - 8 + 6  # after its last use (8) it wraps to its first use (6) of the next step
    assert t.first_use_order(5) == [0, 1, 2, 3, 4]
    assert working_set_bytes([view(i) for i in range(4)], t) == 1000
    assert smallest_working_limit([view(i) for i in range(4)], t) == (1000, 350)


def test_the_working_set_counts_what_other_modules_keep_in_use():
    """[Note: recomputation]: a recomputed module's moment needs its own chunk and the chunk of the module whose
    backward runs the recomputation; a remap to another layout keeps both."""
    ms = list(fake_trace().moments)
    ms.insert(7, Moment(FORWARD, "m2", (2,), (2,), 200, pinned_params=(3,), pinned_chunks=(3,)))  # in backward
    t = Trace(tuple(ms))
    views = [view(i) for i in range(4)]
    assert working_set_bytes(views, t) == 2000
    merged = t.remap({0: 0, 1: 0, 2: 1, 3: 2})  # three chunks: parameters 2 and 3 stay apart
    assert merged.moments[7].chunk_ids == (1,) and merged.moments[7].pinned_chunks == (2,)
    assert working_set_bytes(views[:3], merged) == 2000
    assert working_set_bytes(views, t.remap({0: 0, 1: 1, 2: 2, 3: 2})) == 1000  # one chunk holds both


def test_auto_evicts_farthest_next_use_and_prefetches_exactly():
    t = fake_trace()
    policy = AutoPlacement(ChunkConfig(placement="auto"))
    # at position 4 (forward of chunk 2): chunks 0 and 1 are resident; chunk 0 is next used last (backward)
    chunks = [view(0, True, last=1), view(1, True, last=3), view(2), view(3)]
    plan = policy.plan(position=4, needed=frozenset({2}), chunks=chunks, trace=t, budget_bytes=2000, device_bytes=2000)
    assert plan.evict == (0,)  # Belady: chunk 0's next use (position 11) is farther than chunk 1's (10)
    assert plan.prefetch == ()  # no room left for chunk 3
    plan = policy.plan(position=4, needed=frozenset({2}), chunks=chunks, trace=t, budget_bytes=4000, device_bytes=2000)
    assert plan.evict == () and plan.prefetch == (3,)


def test_lru_without_trace():
    policy = AutoPlacement(ChunkConfig(placement="auto", prefetch=False))
    chunks = [view(0, True, last=5), view(1, True, last=2), view(2)]
    plan = policy.plan(
        position=0, needed=frozenset({2}), chunks=chunks, trace=None, budget_bytes=2000, device_bytes=2000
    )
    assert plan == type(plan)(evict=(1,), prefetch=(), for_room=True)


def test_chunks_in_use_are_never_evicted():
    policy = AutoPlacement(ChunkConfig(placement="auto"))
    chunks = [view(0, True, evictable=False), view(1)]
    plan = policy.plan(
        position=0, needed=frozenset({1}), chunks=chunks, trace=None, budget_bytes=1000, device_bytes=1000
    )
    assert plan.evict == ()


def test_host_policy_releases_after_use_but_keeps_the_next_chunk():
    t = fake_trace()
    policy = HostPlacement(ChunkConfig(placement="host", reshard_after_forward=True))
    chunks = [view(0, True), view(1, True), view(2), view(3)]
    plan = policy.plan(position=2, needed=frozenset({1}), chunks=chunks, trace=t, budget_bytes=None, device_bytes=2000)
    assert plan.evict == (0,) and plan.prefetch == (2, 3)  # the next moment's chunk and the one after it
    assert policy.shard_tiers(chunks, t, None) == {i: Tier.HOST for i in range(4)}


def test_the_prefetch_window_reaches_one_chunk_past_the_next_moment():
    """[Note: how far ahead to gather]: two modules a chunk; at a chunk's first module the next chunk is gathered
    ahead, nearest use first, and only into room."""
    ms = []
    for c in (0, 1, 2):
        for part in ("a", "b"):
            ms.append(Moment(FORWARD, f"m{c}{part}", (c,), (c,), 0))
            ms.append(Moment(POST_FORWARD, f"m{c}{part}", (c,), (c,), 0))
    t = Trace(tuple(ms))
    assert t.prefetch_window(-1) == (0, 1)
    assert t.prefetch_window(0) == (0, 1)  # at m0a: m0b uses chunk 0 again, and chunk 1 comes next
    assert t.prefetch_window(3) == (1, 2)  # after m0b: chunk 1's stretch, then chunk 2
    assert t.prefetch_window(9) == (2,)  # the step's last chunk: nothing after it
    assert t.prefetch_window(11) == ()
    policy = HostPlacement(ChunkConfig(placement="host", reshard_after_forward=True))
    chunks = [view(0, True, evictable=False), view(1), view(2)]
    plan = policy.plan(position=0, needed=frozenset({0}), chunks=chunks, trace=t, budget_bytes=None, device_bytes=1000)
    assert plan.evict == () and plan.prefetch == (1,)
    plan = policy.plan(position=3, needed=frozenset(), chunks=chunks, trace=t, budget_bytes=None, device_bytes=1000)
    assert plan.prefetch == (1, 2)  # nearest use first
    plan = policy.plan(position=3, needed=frozenset(), chunks=chunks, trace=t, budget_bytes=2000, device_bytes=1000)
    assert plan.prefetch == (1,)  # room for one: the nearer
    assert HostPlacement(ChunkConfig(placement="host", prefetch=False)).upcoming(3, t) == frozenset()


def test_host_policy_keeps_a_chunk_used_again_before_the_next_gather():
    """Blocks whose weights are in chunks 1 and 2 and whose norms share chunk 0 (another param group)."""
    ms = []
    for block in (1, 2):
        for module, chunk in ((f"ln{block}", 0), (f"fc{block}", block), (f"ln{block}b", 0), (f"out{block}", block)):
            ms.append(Moment(FORWARD, module, (chunk,), (chunk,), 0))
            ms.append(Moment(POST_FORWARD, module, (chunk,), (chunk,), 0))
    t = Trace(tuple(ms))
    policy = HostPlacement(ChunkConfig(placement="host", reshard_after_forward=True))
    # after fc1 (position 3): chunk 0 comes back at ln1b before any chunk must be gathered: kept
    chunks = [view(0, True), view(1, True), view(2)]
    assert (
        policy.plan(position=3, needed=frozenset(), chunks=chunks, trace=t, budget_bytes=None, device_bytes=2000).evict
        == ()
    )
    # after out1 (position 7): chunk 1 is not used again this step: released; chunk 0 (ln2, next) stays, and
    # chunk 2 (fc2, the chunk after the next moment's) is gathered ahead ([Note: how far ahead to gather])
    plan = policy.plan(position=7, needed=frozenset(), chunks=chunks, trace=t, budget_bytes=None, device_bytes=2000)
    assert plan.evict == (1,) and plan.prefetch == (2,)
    # chunk 0 is used again at ln2b, after fc2 needs chunk 2 gathered: released until then
    chunks = [view(0, True), view(1), view(2)]
    plan = policy.plan(position=8, needed=frozenset({0}), chunks=chunks, trace=t, budget_bytes=None, device_bytes=1000)
    assert plan.evict == () and plan.prefetch == (2,)
    chunks = [view(0, True), view(1), view(2, True)]
    assert (
        policy.plan(position=11, needed=frozenset(), chunks=chunks, trace=t, budget_bytes=None, device_bytes=2000).evict
        == ()
    )  # position 11 = after fc2; ln2b (chunk 0) comes first
    assert t.reused_before_gather(11, frozenset({0, 2})) == frozenset({0, 2})
    assert t.reused_before_gather(3, frozenset({0, 1})) == frozenset({0, 1})
    assert t.reused_before_gather(7, frozenset({0, 1})) == frozenset({0})  # ln2 uses 0, then fc2 needs 2


def test_reused_before_gather_is_its_definition():
    """The set-based scan that stops once every resident chunk is found gives what the docstring defines: the
    resident chunks of the moments after ``position``, up to and including the first that needs another chunk."""
    rng = random.Random(0)
    kinds = (FORWARD, POST_FORWARD, BACKWARD)
    for _ in range(300):
        ms = tuple(
            Moment(rng.choice(kinds), f"m{i}", tuple(sorted(rng.sample(range(6), rng.randint(0, 3)))), (), 0)
            for i in range(rng.randint(0, 12))
        )
        t = Trace(ms)
        for position in range(-1, len(ms) + 1):
            resident = frozenset(rng.sample(range(6), rng.randint(0, 6)))
            expected: set[int] = set()
            for m in ms[position + 1 :]:
                if m.kind == POST_FORWARD or not m.chunk_ids:
                    continue
                expected |= set(m.chunk_ids) & resident
                if not set(m.chunk_ids) <= resident:
                    break
            assert t.reused_before_gather(position, resident) == expected


def test_static_offloads_the_first_fraction():
    policy = StaticPlacement(ChunkConfig(placement="static", offload_fraction=0.5))
    tiers = policy.shard_tiers([view(i) for i in range(5)], None, None)
    assert tiers == {0: Tier.HOST, 1: Tier.HOST, 2: Tier.HOST, 3: Tier.DEVICE, 4: Tier.DEVICE}


@pytest.mark.parametrize(
    "limit,expected_device",
    [
        (None, {0, 1, 2, 3}),  # no limit: everything resident
        (1000 + 1000 + 350, set()),  # room for working set + prefetch + activations only
        (1000 + 1000 + 350 + 4000, {3}),  # one shard's worth more: the last-used chunk stays
        (1000 + 1000 + 350 + 8000, {2, 3}),
    ],
)
def test_auto_shard_tiers_from_trace(limit, expected_device):
    policy = AutoPlacement(ChunkConfig(placement="auto"))
    tiers = policy.shard_tiers([view(i) for i in range(4)], fake_trace(), limit)
    assert {c for c, t in tiers.items() if t is Tier.DEVICE} == expected_device


def test_auto_before_trace_puts_everything_on_host_when_limited():
    policy = AutoPlacement(ChunkConfig(placement="auto"))
    assert set(policy.shard_tiers([view(i) for i in range(3)], None, 10**6).values()) == {Tier.HOST}


def _shards(n, shard=1000, disk=800):
    """``n`` chunks whose shards cost ``shard`` bytes, ``disk`` of them movable to files (the rest: a bf16 copy)."""
    return [
        ChunkView(
            i,
            payload_bytes=100,
            device_shard_bytes=shard,
            resident=False,
            evictable=False,
            shard_tier=Tier.HOST,
            disk_bytes=disk,
        )
        for i in range(n)
    ]


def test_spill_to_disk_moves_the_first_chunks_until_the_host_fits():
    from lightning_chunk.engine.schedule.spill import spill_to_disk

    views = _shards(6)
    tiers = {v.chunk_id: Tier.HOST for v in views}
    assert spill_to_disk(views, tiers, None) == tiers  # no limit: no disk tier
    assert spill_to_disk(views, tiers, 6000) == tiers  # everything fits
    # 6000 bytes on the host; each spilled chunk leaves its 200-byte copy and the window is two disk shards (1600)
    got = spill_to_disk(views, tiers, 4500)
    on_disk = [c for c, t in got.items() if t is Tier.DISK]
    assert on_disk == [0, 1, 2, 3]  # 2 on host (2000) + 4 copies (800) + window (1600) = 4400 <= 4500
    assert tiers[0] is Tier.HOST  # the caller's dict is left alone
    device = {**tiers, 5: Tier.DEVICE}
    assert spill_to_disk(views, device, 4500)[5] is Tier.DEVICE  # device shards never go to disk


def test_spill_to_disk_names_the_smallest_limit_that_works():
    from lightning_chunk.engine.errors import HostMemoryLimitError
    from lightning_chunk.engine.schedule.spill import spill_to_disk

    views = _shards(6)
    with pytest.raises(
        HostMemoryLimitError,
        match=r"host_memory_limit=2000 bytes \(1.95 KiB\) is too small.*holds "
        r"1200 bytes of shards.*up to 1600 bytes.*smallest "
        r"limit that works is 2800 bytes \(2.73 KiB\)",
    ):
        spill_to_disk(views, {v.chunk_id: Tier.HOST for v in views}, 2000)
    # a user who left the chunk size to us is not told to lower it ([Note: an automatic chunk size that fits])
    with pytest.raises(
        HostMemoryLimitError, match=r"works is 2800 bytes \(2.73 KiB\); chunk_numel=None already keeps"
    ) as e:
        spill_to_disk(views, {v.chunk_id: Tier.HOST for v in views}, 2000, chunk_numel_chosen=False)
    assert "lower chunk_numel" not in str(e.value)


def random_moments(policy_cls, seed, count, n_chunks, p_resident):
    """``count`` random moments for a policy of ``policy_cls``: (policy, every chunk's view, the needed and upcoming
    chunk ids, ``plan``'s other arguments), at every position, whatever is resident, in use or over budget."""
    import random

    rng = random.Random(seed)
    releases = (None, True) if policy_cls is HostPlacement else (None,)  # host: keeping for backward, and not
    policies = [
        policy_cls(ChunkConfig(placement=policy_cls.name, prefetch=p, reshard_after_forward=r))
        for p in (True, False)
        for r in releases
    ]
    for _ in range(count):
        policy = rng.choice(policies)
        t = rng.choice((fake_trace(), None))  # no trace: the warm-up, and evaluation
        position = rng.randrange(12)
        chunks = []
        for cid in range(n_chunks):
            resident = rng.random() < p_resident
            chunks.append(
                view(
                    cid,
                    resident,
                    evictable=resident and rng.random() < 0.7,
                    last=rng.randrange(-1, 12),
                    payload=rng.choice((500, 1000, 1500)),
                )
            )
        needed = frozenset(rng.sample(range(n_chunks), rng.randrange(3)))
        budget = rng.choice((None, 1000, 2500, 4000))
        device = sum(c.payload_bytes for c in chunks if c.resident)
        wanted = policy.upcoming(position, t) | needed
        yield (
            policy,
            chunks,
            wanted,
            dict(position=position, needed=needed, trace=t, budget_bytes=budget, device_bytes=device),
        )


@pytest.mark.parametrize("policy_cls", [AutoPlacement, HostPlacement, StaticPlacement])
def test_a_plan_reads_only_resident_needed_and_upcoming_chunks(policy_cls):
    """The hooks hand ``plan`` the views of those chunks alone ([Note: the views a plan reads]): the same plan as
    from every chunk."""
    for policy, chunks, wanted, kwargs in random_moments(policy_cls, seed=0, count=300, n_chunks=6, p_resident=0.5):
        narrowed = [c for c in chunks if c.resident or c.chunk_id in wanted]
        assert policy.plan(chunks=narrowed, **kwargs) == policy.plan(chunks=chunks, **kwargs)


@pytest.mark.parametrize("policy_cls", [AutoPlacement, HostPlacement, StaticPlacement])
def test_a_moment_skipped_as_idle_would_have_planned_nothing(policy_cls):
    """The hooks skip ``plan`` (and every view) when ``idle`` says it would do nothing: an idle moment's plan is
    empty, and idle moments do occur (never with host placement, which releases after use)."""
    idle_seen = 0
    for policy, chunks, wanted, kwargs in random_moments(policy_cls, seed=1, count=600, n_chunks=4, p_resident=0.8):
        if policy.idle(
            all_resident=all(chunks[i].resident for i in wanted),
            budget_bytes=kwargs["budget_bytes"],
            device_bytes=kwargs["device_bytes"],
        ):
            idle_seen += 1
            plan = policy.plan(chunks=chunks, **kwargs)
            assert plan.evict == () and plan.prefetch == ()
    assert idle_seen == 0 if policy_cls is HostPlacement else idle_seen > 50


def test_host_placement_keeps_payloads_for_backward_unless_told_to_release():
    """[Note: keeping payloads for backward]: by default kept until their last use in the step, and under a budget
    the farthest next use still goes first; with ``reshard_after_forward=True`` released after use."""
    t = fake_trace()
    released = HostPlacement(ChunkConfig(placement="host", prefetch=False, reshard_after_forward=True))
    kept = HostPlacement(ChunkConfig(placement="host", prefetch=False))
    assert HostPlacement(ChunkConfig(placement="host", reshard_after_forward=False)).keeps_for_backward
    # forward of chunk 2 (position 4): chunks 0 and 1 are resident from their forward
    chunks = [view(0, True, last=0), view(1, True, last=2), view(2), view(3)]
    args = dict(position=4, needed=frozenset({2}), chunks=chunks, trace=t, device_bytes=2000)
    assert released.plan(budget_bytes=None, **args).evict == (0, 1)
    assert not released.plan(budget_bytes=None, **args).for_room  # released after use, not for memory
    assert kept.plan(budget_bytes=None, **args).evict == ()
    # what is kept leaves room for the traced activations (250 here): chunk 0's backward (position 11) is the
    # farthest and goes first, then chunk 1's
    assert kept.plan(budget_bytes=2500, **args).evict == (0,)
    assert kept.plan(budget_bytes=2500, **args).for_room  # [Note: moments with nothing to release] in hooks.py
    assert kept.plan(budget_bytes=2000, **args).evict == (0, 1)
    # backward of chunk 1 (position 10): chunk 2 was used for the last time in this step (9), chunk 0 is next (11)
    chunks = [view(0, True), view(1, True, evictable=False), view(2, True), view(3)]
    plan = kept.plan(position=10, needed=frozenset({1}), chunks=chunks, trace=t, budget_bytes=None, device_bytes=3000)
    assert plan.evict == (2,)
    # without a trace (the warm-up, evaluation) both release after use
    assert kept.plan(
        position=4,
        needed=frozenset({2}),
        chunks=chunks[:1] + [view(2)],
        trace=None,
        budget_bytes=None,
        device_bytes=1000,
    ).evict == (0,)
    # keeping never evicts what releasing after use keeps: chunk 0 is used again at position 6 (reused before the
    # next gather), kept by both under a budget that has room for it but not for the activations beside it too
    ms = [
        Moment(FORWARD, "a", (0,), (0,), 0),
        Moment(FORWARD, "b", (1,), (1,), 900),
        Moment(FORWARD, "c", (0,), (0,), 900),
        Moment(BACKWARD, "b", (1,), (1,), 0),
        Moment(BACKWARD, "a", (0,), (0,), 0),
    ]
    t2 = Trace(tuple(ms))
    chunks = [view(0, True, last=0), view(1)]
    for policy in (kept, released):
        assert (
            policy.plan(
                position=1, needed=frozenset({1}), chunks=chunks, trace=t2, budget_bytes=2000, device_bytes=1000
            ).evict
            == ()
        )
    assert kept.budget(5000, t, 4) == released.budget(5000, t, 4) == 5000


def test_chunks_ahead_are_the_next_distinct_chunks_in_first_use_order_within_the_step():
    """What the disk tier's gathers read ahead ([Note: the gathers' reads ahead of use] in disk_storage.py)."""
    m = lambda kind, *cids: Moment(kind, "m", tuple(cids), (), 0)  # noqa: E731
    trace = Trace(
        (m(FORWARD, 0), m(FORWARD, 1, 2), m(POST_FORWARD, 9), m(FORWARD, 2, 3), m(BACKWARD, 3), m(BACKWARD, 1, 0))
    )
    assert trace.chunks_ahead(0, 4) == [1, 2, 3, 0]
    assert trace.chunks_ahead(0, 2) == [1, 2]
    assert trace.chunks_ahead(3, 4) == [3, 1, 0]
    assert trace.chunks_ahead(5, 4) == []


def test_steps_without_a_trace_leave_the_activations_room_under_the_limit():
    """[Note: steps without a trace]: with auto placement under a limit, the warm-up and an evaluation forward once
    kept payloads up to the whole limit (8 of 8 MiB here), leaving activations only the margin below the device's
    memory. The warm-up now keeps each module's chunks while it runs; an evaluation step keeps what the training
    trace's activation peak leaves."""
    import torch

    from lightning_chunk.engine import ChunkConfig, ChunkEngine
    from lightning_chunk.engine.chunks.chunk import Tier
    from tests.engine_steps import step

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(12)])  # 1 MiB a layer
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    limit = 8 << 20
    eng = ChunkEngine(
        model,
        [opt],
        config=ChunkConfig(placement="auto", device_memory_limit=limit, chunk_numel=262144),
        device=torch.device("cpu"),
    )
    peak = [0]
    eng.manager.on_change = lambda: peak.__setitem__(0, max(peak[0], eng.manager.ledger[Tier.DEVICE]))
    x = torch.randn(128, 512)
    peaks = []
    for _ in range(3):
        peak[0] = 0
        step(eng, model, opt, x)
        peaks.append(peak[0])
    activations = eng.hooks.moments.trace.nonmodel_peak_bytes
    assert activations >= 2 << 20
    assert peaks[0] <= 2 << 20  # the warm-up: a layer's payload and its gradient payload
    assert peaks[1] > limit - activations  # traced steps keep more where the activations have room at that moment
    peak[0] = 0
    with torch.no_grad(), eng.micro_batch(training=False) as outputs:
        outputs(model(x))
    assert 0 < peak[0] <= limit - activations


def test_auto_gives_the_host_the_chunks_backward_finishes_first_where_they_step_beside_it():
    """[Note: which chunks the host gets]: stepping after backward the last chunks in use order stay on the device;
    stepping beside backward on a worker, the first ones, so that the host chunks' gradients are final early in
    backward and their steps overlap the rest of it. Either way training is the same, bit for bit."""
    import torch
    import torch.nn as nn

    from lightning_chunk.engine import ChunkEngine
    from tests.engine_steps import step

    def run(thread: bool):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        config = ChunkConfig(
            placement="auto", chunk_numel=300, device_memory_limit=16000, step_in_backward=True, step_thread=thread
        )
        eng = ChunkEngine(model, [opt], config=config)
        assert eng.policy.beside_backward is thread
        for i in range(3):
            step(eng, model, opt, torch.randn(3, 16, generator=torch.Generator().manual_seed(i)))
        return "".join(c.shard_tier.name[0] for c in eng.manager.chunks), eng.full_state_dict()

    (beside, got), (after, want) = run(True), run(False)
    assert beside == "DDHHHHHH" and after == "HHHHHHDD"
    assert all(torch.equal(got[k], v) for k, v in want.items())
