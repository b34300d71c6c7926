import dataclasses

import pytest
import torch

from lightning_chunk.engine.config import ChunkConfig, parse_bytes, resolve_reshard_after_forward
from lightning_chunk.engine.runtime.description import plan_from_shapes


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("placement", "gpu", "placement='gpu'"),
        ("optimizer_kernel", "fast", "optimizer_kernel='fast'"),
        ("offload_fraction", 1.5, "offload_fraction=1.5"),
        ("offload_fraction", True, "offload_fraction=True"),
        ("chunk_numel", 0, "chunk_numel=0"),
        ("chunk_numel", -4, "chunk_numel=-4"),
        ("chunk_numel_min", 2.5, "chunk_numel_min=2.5"),
        ("device_memory_limit", -1, "device_memory_limit=-1"),
        ("device_memory_limit", "lots", "device_memory_limit='lots'"),
        ("device_memory_limit", "12 parsecs", "device_memory_limit='12 parsecs'"),
        ("prefetch", "yes", "prefetch='yes'"),
        ("reshard_after_forward", "no", "reshard_after_forward='no'"),
        ("reshard_after_forward", True, "only placement='host' releases payloads after use"),  # with placement='auto'
        ("leaf_modules", "MyBlock", "leaf_modules='MyBlock'"),  # a string, not a list of them
        ("leaf_modules", [int], "list of torch.nn.Module subclasses or class names"),
        ("leaf_modules", [""], "leaf_modules=['']"),
        (
            "verify_collectives",
            "sometimes",
            "verify_collectives='sometimes' is not allowed; it must be None, True, False, 'each' or 'batch'",
        ),
        ("verify_collectives", 1, "verify_collectives=1"),
        ("broadcast_buffers", None, "broadcast_buffers=None"),
        ("shard_size", 1, "shard_size=1 is not allowed; it must be None (every rank), 'node'"),
        ("shard_size", "rack", "shard_size='rack'"),
        ("shard_size", True, "shard_size=True"),
    ],
)
def test_bad_values_name_field_value_and_choices(field, value, needle):
    with pytest.raises(ValueError) as e:
        ChunkConfig(**{field: value})
    assert needle in str(e.value)


def test_min_above_max_is_rejected():
    with pytest.raises(ValueError, match="chunk_numel_min=8 is larger than chunk_numel_max=4"):
        ChunkConfig(chunk_numel_min=8, chunk_numel_max=4)


@pytest.mark.parametrize(
    "value,expected",
    [
        (1000, 1000),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2gib", 2 * 2**30),
        ("64", 64),
        (None, None),
        ("12G", 12 * 10**9),
        ("12GB", 12 * 10**9),
        ("12 gib", 12 * 2**30),
        ("12Gi", 12 * 2**30),
        ("3 k", 3000),
        (2e9, 2 * 10**9),
        ("1e3", 1000),
    ],
)
def test_parse_bytes(value, expected):
    """[Note: memory sizes]: K/M/G/T and KB/MB/GB/TB are powers of 1000, Ki/Mi/Gi/Ti and KiB/... powers of 1024."""
    assert parse_bytes(value, field="x") == expected


@pytest.mark.parametrize(
    "value,needle",
    [
        (0.5, "not a whole number of bytes"),
        (-5, "must be a positive number"),
        ("-1GiB", "must be a positive number"),
        ("0.5", "must be a positive number"),
        (0, "must be a positive number"),
        ("twelve", "is not a memory size"),
        ("12 GiBs", "is not a memory size"),
        (True, "is not a memory size"),
        (float("nan"), "must be a positive number"),
    ],
)
def test_bad_memory_sizes_are_refused_with_the_accepted_forms(value, needle):
    with pytest.raises(ValueError) as e:
        parse_bytes(value, field="device_memory_limit")
    msg = str(e.value)
    assert f"device_memory_limit={value!r}" in msg and needle in msg
    assert "KiB" in msg and "powers of 1000" in msg and "powers of 1024" in msg  # the forms it takes


def test_config_is_frozen_and_replace_makes_a_new_one():
    c = ChunkConfig(device_memory_limit="1MiB")
    assert c.device_memory_limit == 2**20
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.placement = "host"  # type: ignore[misc]
    d = c.replace(placement="host")
    assert (c.placement, d.placement, d.device_memory_limit) == ("auto", "host", 2**20)


def test_the_default_device_limit_is_none_on_cpu_and_leaves_a_stated_margin_on_cuda():
    from lightning_chunk.engine.config import default_device_limit, device_margin_bytes

    assert default_device_limit(torch.device("cpu")) is None
    assert device_margin_bytes(80 * 2**30) == 8 * 2**30  # 10% of an 80 GiB device
    assert device_margin_bytes(4 * 2**30) == 2**30  # at least 1 GiB


def test_the_strategy_s_arguments_and_groups_cover_every_config_field_with_its_default():
    """The twelve arguments and the three groups are flattened into a ChunkConfig by name: a field neither has, or a
    default that drifted from the config's, would silently change what a user gets."""
    import dataclasses
    import inspect

    from lightning_chunk.options import ARGUMENTS, GROUPS
    from lightning_chunk.strategy import ChunkOffloadStrategy

    params = {k: p for k, p in inspect.signature(ChunkOffloadStrategy.__init__).parameters.items() if k != "self"}
    named = [k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 12 and named == list(ARGUMENTS), named  # each argument documented, in the same order
    given = {k: params[k].default for k in named}
    given |= {f.name: f.default for g in GROUPS.values() for f in dataclasses.fields(g)}
    fields = {f.name: f.default for f in dataclasses.fields(ChunkConfig) if f.name != "check_invariants"}
    for name, default in fields.items():
        assert name in given, name
        assert given[name] == default, (name, given[name], default)
    assert ChunkOffloadStrategy().config == ChunkConfig()


def test_a_group_is_a_dataclass_or_a_dict_and_a_flat_name_still_works_with_a_deprecation_warning():
    import warnings

    from lightning_chunk import CheckOptions, ChunkOffloadStrategy, MemoryOptions

    s = ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=4096), checks={"collective_timeout_s": 7})
    assert s.config.chunk_numel == 4096 and s.config.collective_timeout_s == 7
    assert s.checks == CheckOptions(collective_timeout_s=7)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        old = ChunkOffloadStrategy(chunk_numel=4096, verify_collectives=True, memory={"chunk_numel_min": 8})
    messages = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
    assert [m.split(")")[0] for m in messages] == [
        "ChunkOffloadStrategy(chunk_numel=...",
        "ChunkOffloadStrategy(verify_collectives=...",
    ]
    assert "memory=MemoryOptions(chunk_numel=...)" in messages[0] and "checks=CheckOptions(" in messages[1]
    assert (old.config.chunk_numel, old.config.chunk_numel_min, old.config.verify_collectives) == (4096, 8, True)


def test_a_misspelt_argument_or_group_field_names_what_is_allowed():
    from datetime import timedelta

    from lightning_chunk import ChunkOffloadStrategy

    with pytest.raises(TypeError, match=r"unexpected keyword argument 'chunk_size'; its arguments are placement"):
        ChunkOffloadStrategy(chunk_size=4096)
    with pytest.raises(ValueError, match=r"memory=\{'chunk_size': 1\} names chunk_size, which MemoryOptions"):
        ChunkOffloadStrategy(memory={"chunk_size": 1})
    with pytest.raises(ValueError, match=r"offload=3 is not allowed; it must be an OffloadOptions"):
        ChunkOffloadStrategy(offload=3)
    with pytest.raises(ValueError, match=r"timeout=-1 is not allowed; it must be a positive datetime.timedelta"):
        ChunkOffloadStrategy(timeout=-1)  # torch.distributed would refuse it only when several ranks start
    with pytest.raises(ValueError, match=r"timeout=datetime.timedelta\(0\) is not allowed"):
        ChunkOffloadStrategy(timeout=timedelta(0))
    with pytest.raises(ValueError, match=r"chunk_numel=0 is not allowed"):
        ChunkOffloadStrategy(memory={"chunk_numel": 0})


def test_grouped_moves_flat_names_into_their_groups_and_the_flat_name_wins():
    from lightning_chunk import MemoryOptions
    from lightning_chunk.options import grouped

    assert grouped({"placement": "host", "chunk_numel": 8, "disk_io": "direct"}) == {
        "placement": "host",
        "memory": {"chunk_numel": 8},
        "offload": {"disk_io": "direct"},
    }
    got = grouped({"memory": MemoryOptions(chunk_numel=8, offload_fraction=0.25), "chunk_numel": 16})
    assert got["memory"] == MemoryOptions(chunk_numel=16, offload_fraction=0.25)
    assert grouped({"memory": {"chunk_numel_min": 2}, "chunk_numel": 16})["memory"] == {
        "chunk_numel_min": 2,
        "chunk_numel": 16,
    }


def test_disk_tier_fields_are_validated():
    with pytest.raises(ValueError, match="host_memory_limit='lots'"):
        ChunkConfig(host_memory_limit="lots")
    with pytest.raises(ValueError, match="disk_dir=3"):
        ChunkConfig(disk_dir=3)
    assert ChunkConfig(host_memory_limit="1GiB", disk_dir="/tmp").host_memory_limit == 1 << 30
    with pytest.raises(ValueError, match=r"disk_io='odirect' is not allowed; choose one of auto, direct, buffered"):
        ChunkConfig(disk_io="odirect")
    assert ChunkConfig(disk_io="direct").disk_io == "direct"


def test_reshard_after_forward_goes_with_host_placement():
    """FSDP2's option: host placement keeps payloads for backward within the budget unless told to release them;
    the other placements keep payloads until the budget needs the room, so ``False`` is what they do and ``True``
    cannot be honoured."""
    assert ChunkConfig(placement="host").reshard_after_forward is None
    assert ChunkConfig(placement="host", reshard_after_forward=True).reshard_after_forward is True
    assert ChunkConfig(placement="auto", reshard_after_forward=False).reshard_after_forward is False
    for placement in ("auto", "device", "static"):
        with pytest.raises(ValueError, match=f"reshard_after_forward=True is not allowed with placement='{placement}'"):
            ChunkConfig(placement=placement, reshard_after_forward=True)


def test_leaf_modules_own_their_subtree():
    """[Note: leaf modules]: torch's attention and encoder layers always, a user's class by type, by name or by an
    importable path (re-exported: ``torch.nn.Linear`` lives in ``torch.nn.modules.linear``)."""
    from lightning_chunk.engine.runtime.leaves import LeafModules

    test = LeafModules(["Sequential"])
    assert test(torch.nn.MultiheadAttention(8, 2)) and test(torch.nn.TransformerEncoderLayer(8, 2, 16))
    assert test(torch.nn.Sequential()) and not test(torch.nn.Linear(2, 2))
    for entry in (torch.nn.Linear, "Linear", "torch.nn.Linear", "torch.nn.modules.linear.Linear"):
        test = LeafModules([entry, "NoSuchBlock"])
        assert test(torch.nn.Linear(2, 2)) and test.unmatched() == ["NoSuchBlock"]


def test_a_leaf_module_the_model_lacks_is_an_error_that_lists_its_classes():
    from lightning_chunk.engine.config import ChunkConfig

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"\['MyBlok'\] names no module of this model.*LayerNorm, Linear, Sequential"):
        plan_from_shapes(model, config=ChunkConfig(leaf_modules=("MyBlok",)))


@pytest.mark.parametrize("value", [None, True, False, "each", "batch"])
def test_verify_collectives_takes_its_modes(value):
    assert ChunkConfig(verify_collectives=value).verify_collectives == value


def test_reshard_after_forward_none_keeps_on_an_accelerator_only():
    """``None`` keeps payloads for backward within an accelerator's budget; on a CPU device, with or without a
    ``device_memory_limit``, the payloads are host memory and the trace does not see all of it, so they are released
    after use ([Note: keeping payloads for backward]). A choice the user made is left alone, and so are the other
    placements."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    host = ChunkConfig(placement="host")
    limited = ChunkConfig(placement="host", device_memory_limit="1GiB")
    disk = ChunkConfig(placement="host", host_memory_limit="1GiB", disk_dir="/tmp")
    assert resolve_reshard_after_forward(host, cpu).reshard_after_forward is True
    assert resolve_reshard_after_forward(disk, cpu).reshard_after_forward is True
    assert resolve_reshard_after_forward(limited, cpu).reshard_after_forward is True
    assert resolve_reshard_after_forward(limited, cuda).reshard_after_forward is False
    assert resolve_reshard_after_forward(host, cuda).reshard_after_forward is False
    assert resolve_reshard_after_forward(disk, cuda).reshard_after_forward is False
    kept = host.replace(reshard_after_forward=False)
    assert resolve_reshard_after_forward(kept, cpu).reshard_after_forward is False
    assert resolve_reshard_after_forward(host.replace(reshard_after_forward=True), cuda).reshard_after_forward is True
    assert resolve_reshard_after_forward(ChunkConfig(placement="auto"), cpu).reshard_after_forward is None


@pytest.mark.parametrize("on", [False, True])
def test_a_frozen_chunk_costs_its_compute_copy_alone_when_asked(on):
    """[Note: frozen weights in the compute dtype]: placement and `plan` see what the engine builds: under bf16-mixed
    a frozen chunk of 1,024 elements on one rank is its bf16 payload (2 KiB) with the option, and that beside an fp32
    master (6 KiB) without it; a trainable chunk keeps its fp32 master and gradient either way."""
    from lightning_chunk.engine.chunks.packing import ChunkKey, ParamSpec, build_layout
    from lightning_chunk.engine.config import DtypePolicy
    from lightning_chunk.engine.schedule.costs import planned_views

    frozen, trainable = ChunkKey(-1, False, torch.float32), ChunkKey(0, True, torch.float32)
    specs = [ParamSpec(0, "base", 1024, frozen), ParamSpec(1, "adapter", 1024, trainable)]
    layout = build_layout(specs, [0, 1], 1024, 1)
    dtypes = DtypePolicy(torch.bfloat16, torch.float32, frozen_in_compute_dtype=on)
    base, adapter = planned_views(layout, dtypes, {0: 8})
    assert base.device_shard_bytes == (2 if on else 6) * 1024
    assert adapter.device_shard_bytes == (2 + 4 + 4 + 8) * 1024  # payload, master, gradient, Adam's moments


@pytest.mark.parametrize("ranks", [1, 2])
def test_planned_views_cost_what_the_built_chunks_cost_when_payloads_keep_their_own_dtype(ranks):
    """Placement before the chunks exist (the warm-up's layout choice, a repack, ``plan``) reads ``planned_views``: it
    sized an embedding's or a BatchNorm's payload in the compute dtype, half of the float32 payload the engine builds
    ([Note: normalisation in mixed precision]), so a limit could be planned for chunks that did not fit it."""
    from lightning_chunk import ChunkPrecision
    from lightning_chunk.engine import ChunkEngine
    from lightning_chunk.engine.comm.collectives import Collectives
    from lightning_chunk.engine.config import ChunkConfig
    from lightning_chunk.engine.schedule.costs import chunk_views, planned_views

    model = torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 8)
    )
    opt = torch.optim.Adam(model.parameters())
    dtypes = ChunkPrecision("16-mixed").dtype_policy()
    collectives = Collectives.planning(ranks) if ranks > 1 else None
    eng = ChunkEngine(
        model, [opt], config=ChunkConfig(placement="host", chunk_numel=2048), dtypes=dtypes, collectives=collectives
    )
    mgr = eng.manager
    assert any(c.key.own_dtype for c in mgr.layout.chunks) and not all(c.key.own_dtype for c in mgr.layout.chunks)
    planned = planned_views(mgr.layout, mgr.dtypes, eng.description.optim_bytes)
    built = chunk_views(mgr.chunks)
    assert [(v.payload_bytes, v.device_shard_bytes, v.disk_bytes) for v in planned] == [
        (v.payload_bytes, v.device_shard_bytes, v.disk_bytes) for v in built
    ]


def test_mixed_precision_gives_each_parameter_dtype_its_master():
    """fp32 parameters get fp32 masters and bf16 payloads; a float64 one keeps float64 for both ([Note: float64
    parameters under mixed precision]); a frozen bf16 one keeps bf16, a trainable one gets an fp32 master ([Note:
    low-precision parameters under mixed precision]); 32-true and bf16-true keep what they always did."""
    from lightning_chunk.engine.config import DtypePolicy

    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    mixed, true_bf16, full = DtypePolicy(bf16, f32), DtypePolicy(bf16, bf16), DtypePolicy()
    assert [mixed.master_for(d) for d in (f32, f64, bf16)] == [f32, f64, f32]
    assert [mixed.master_for(d, trainable=False) for d in (f32, f64, bf16)] == [f32, f64, bf16]
    assert [true_bf16.master_for(d, trainable=t) for d in (bf16, f32) for t in (True, False)] == [bf16] * 4
    assert [full.master_for(d) for d in (f32, f64, bf16)] == [f32, f64, bf16]
    model = torch.nn.Linear(2, 2)
    model.scale = torch.nn.Parameter(torch.ones(2, dtype=f64))
    assert mixed.own_dtype_params(model) == {id(model.scale)} and not full.own_dtype_params(model)


def test_fp32_embeddings_and_norms_keeps_embeddings_norms_scalars_and_vectors_in_their_own_dtype():
    """What autocast computes in fp32 under Lightning's mixed precision, as far as set-up can tell: an embedding, a
    norm, a temperature, a class token (one dimension longer than 1), and a Linear's bias, which its op casts as it
    casts the fp32 parameter; not a Linear's weight, nor a matrix of a module's own."""
    from lightning_chunk.engine.config import DtypePolicy

    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    model.temperature = torch.nn.Parameter(torch.tensor(1.0))
    model.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 4))
    model.positions = torch.nn.Parameter(torch.zeros(1, 3, 4))
    kept = DtypePolicy(torch.float16, torch.float32, embeddings_and_norms_own_dtype=True).own_dtype_params(model)
    named = {n for n, p in model.named_parameters() if id(p) in kept}
    assert named == {"0.weight", "1.weight", "1.bias", "2.bias", "temperature", "cls_token"}
    assert not DtypePolicy(torch.float16, torch.float32).own_dtype_params(model)


@pytest.mark.parametrize("value", ["bf16", torch.int8, torch.float64, 16])
def test_a_reduce_dtype_that_is_not_a_float_of_32_bits_or_fewer_is_refused(value):
    from lightning_chunk import ChunkPrecision

    with pytest.raises(ValueError, match=rf"reduce_dtype={value!r} is not allowed; it must be None"):
        ChunkPrecision("bf16-mixed", reduce_dtype=value)


def test_the_reduce_dtype_narrows_fp32_gradient_payloads_only():
    """FSDP's ``reduce_dtype``: an fp32 master's gradients are summed in bf16 (half the payload's bytes for placement);
    a float64 master's are not narrowed, nor a bf16-true master's widened."""
    from lightning_chunk import ChunkPrecision
    from lightning_chunk.engine.chunks.packing import ChunkKey, ParamSpec, build_layout
    from lightning_chunk.engine.schedule.costs import planned_views

    policy = ChunkPrecision("bf16-mixed", reduce_dtype="bfloat16").dtype_policy()
    assert [policy.reduce_for(d) for d in (torch.float32, torch.float64)] == [torch.bfloat16, torch.float64]
    assert ChunkPrecision("bf16-true", reduce_dtype=torch.float32).dtype_policy().reduce_for(torch.bfloat16) == (
        torch.bfloat16
    )
    layout = build_layout([ParamSpec(0, "w", 1024, ChunkKey(0, True, torch.float32))], [0], 1024, 2)
    (narrow,), (whole,) = (planned_views(layout, p, {}) for p in (policy, ChunkPrecision("bf16-mixed").dtype_policy()))
    assert 2 * narrow.grad_payload_bytes == whole.grad_payload_bytes == 4 * 1024
