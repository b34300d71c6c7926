"""``lightning-chunk plan`` from a user's side: a model named as ``module:Class``, a report that adds up."""

import pytest

from tests.models import ParityNet


def test_plan_takes_module_colon_class_and_says_in_one_line_that_it_needs_data():
    from lightning_chunk.plan import load_class, plan_from_args

    assert load_class("tests.models:ParityNet") is ParityNet and load_class("tests.models.ParityNet") is ParityNet
    with pytest.raises(ValueError, match=r"no train_dataloader.*--data") as e:
        plan_from_args("tests.models:ParityNet", None, None, None, None, {}, None)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"is not a file \(a path is taken from the current folder"):
        plan_from_args("no/such/file.py:Model", None, None, None, None, {}, None)


def test_plan_report_adds_up_and_prints_small_sizes_in_their_unit():
    from lightning_chunk.plan import plan_from_args

    report = plan_from_args(
        "tests.models:ParityNet",
        "tests.models:TokenData",
        None,
        None,
        None,
        {"device_memory_limit": "300 KiB", "chunk_numel": 4096},
        None,
    )
    text = report.render()
    line = text.split("chunks")[1].splitlines()[0]
    total, params, padding = (
        int(x.replace(",", ""))
        for x in (
            line.split(": ")[1].split(" elements")[0],
            line.split("= ")[1].split(" parameters")[0],
            line.split("+ ")[1].split(" padding")[0],
        )
    )
    assert total == params + padding and params == report.param_numel
    assert "0.00 GiB" not in text and "0.0 MiB" not in text and "300.00 KiB: fits" in text


def test_plan_reads_the_precision_of_a_chunk_precision_plugin_in_the_config(tmp_path):
    """A LightningCLI config may set the precision through ``trainer.plugins`` (``ChunkPrecision`` with its other
    arguments) instead of ``trainer.precision``: it was planned as 32-true."""
    from lightning_chunk.plan import plan_from_args

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  plugins:\n    - class_path: lightning_chunk.ChunkPrecision\n      init_args:\n"
        "        precision: bf16-mixed\n        reduce_dtype: bfloat16\n"
    )
    args = ("lightning_chunk.shapes:Llama", None, str(config), '{"size": "7b"}', None, {})
    assert plan_from_args(*args, None, shapes_only=True, ranks=8).precision == "bf16-mixed"
    assert plan_from_args(*args, "32-true", shapes_only=True, ranks=8).precision == "32-true"  # the flag wins


def test_plan_sizes_gradient_payloads_in_the_reduce_dtype_of_the_config_and_whole_chunks_in_the_master_dtype(tmp_path):
    """``ChunkPrecision(reduce_dtype=...)`` halves the gradient payloads: the plan ignored it (fp32 payloads), and the
    host terms took the payload's size for a whole chunk's fp32 values, so reading it alone would have halved them
    too. With it read, every payload is half, and every host peak of an 8-GPU node is the same."""
    from lightning_chunk.plan import plan_from_args

    reports = {}
    for name, extra in (("fp32", ""), ("bf16", "        reduce_dtype: bfloat16\n")):
        config = tmp_path / f"{name}.yaml"
        config.write_text(
            "trainer:\n  plugins:\n    - class_path: lightning_chunk.ChunkPrecision\n      init_args:\n"
            "        precision: bf16-mixed\n" + extra
        )
        args = ("lightning_chunk.shapes:Llama", None, str(config), '{"size": "7b"}', None, {}, None)
        reports[name] = (
            plan_from_args(*args, shapes_only=True, ranks=8).plan,
            plan_from_args(*args, cluster=(1, 8, 80 << 30, 1 << 40)),
        )
    (full, full_node), (half, half_node) = reports["fp32"], reports["bf16"]
    assert [2 * v.grad_payload_bytes for v in half.views] == [v.grad_payload_bytes for v in full.views]
    assert min(v.grad_payload_bytes for v in half.views if v.grad_payload_bytes) > 0
    assert half.master_chunk_bytes == full.master_chunk_bytes == max(v.grad_payload_bytes for v in full.views)
    assert [p.host for p in half_node.phases] == [p.host for p in full_node.phases]
    assert sum(p.device for p in half_node.phases) < sum(p.device for p in full_node.phases)


def test_plan_sizes_payloads_in_the_dtypes_the_config_s_precision_plugin_keeps(tmp_path):
    """``ChunkPrecision``'s ``fp32_embeddings_and_norms`` and ``full_precision_modules`` decide which payloads stay
    float32 under mixed precision; plan, from shapes and in its dry run, took the precision's defaults instead. Under
    16-mixed the embeddings and norms are float32 by default, fp16 when the config says False; a class named as a path
    in ``full_precision_modules`` keeps float32 under bf16-mixed too."""
    from lightning_chunk.plan import plan_from_args

    def config(name: str, precision: str, extra: str = "") -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            "trainer:\n  plugins:\n    - class_path: lightning_chunk.ChunkPrecision\n      init_args:\n"
            f"        precision: {precision}\n" + extra
        )
        return str(path)

    configs = {
        "fp32": config("fp32", "16-mixed"),
        "fp16": config("fp16", "16-mixed", "        fp32_embeddings_and_norms: false\n"),
        "bf16": config("bf16", "bf16-mixed"),
        "linear": config("linear", "bf16-mixed", "        full_precision_modules: [torch.nn.Linear]\n"),
    }
    shapes = {
        k: sum(
            v.payload_bytes
            for v in plan_from_args(
                "lightning_chunk.shapes:Llama",
                None,
                c,
                '{"size": {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 4, "kv_heads": 4, "vocab": 256}}',
                None,
                {},
                None,
                shapes_only=True,
            ).plan.views
        )
        for k, c in configs.items()
    }
    assert shapes["fp16"] == shapes["bf16"] < shapes["fp32"] < shapes["linear"], shapes
    dry = {
        k: plan_from_args(
            "tests.models:ParityNet", "tests.models:TokenData", c, None, None, {"chunk_numel": 4096}, None
        )
        for k, c in configs.items()
    }
    assert dry["fp16"].payload_bytes_max == dry["bf16"].payload_bytes_max < dry["linear"].payload_bytes_max, dry
    assert dry["fp16"].precision == "16-mixed"  # a CPU Trainer given '16-mixed' runs bf16-mixed: the plan did
    args = ("tests.models:ParityNet", "tests.models:TokenData", None, None, None, {"chunk_numel": 4096}, "16-mixed")
    assert plan_from_args(*args).precision == "16-mixed"


def test_the_dry_run_counts_a_chunk_ema_s_average_where_asked():
    """``plan --ema`` on a model it builds: the average is each trainable chunk's shard in fp32, in host memory, or in
    files with a host limit ([Note: the average under a host limit])."""
    from lightning_chunk.plan import plan_from_args

    args = ("tests.models:ParityNet", "tests.models:TokenData", None, None, None)
    plain = plan_from_args(*args, {"chunk_numel": 4096}, None)
    report = plan_from_args(*args, {"chunk_numel": 4096}, None, ema=True)
    assert plain.average_bytes == 0 and "ChunkEMA" not in plain.render()
    assert report.average_bytes == 4 * (report.param_numel + report.padding_numel), report.render()
    assert "in host memory" in report.render()


def test_under_a_limit_too_small_plan_names_one_that_a_fit_then_trains_under():
    """Before, plan's dry run was refused where the fit was, before anything was traced, and printed the same lower
    bound "plus the activations" whose error sends the user to plan: the example GPT took three tries. Now a dry run
    without the limit traces what it must hold, and the limit named is checked by a dry run under it."""
    import re

    from lightning_chunk import ChunkOffloadStrategy
    from lightning_chunk.engine import ChunkError
    from lightning_chunk.plan import plan_from_args
    from tests.models import fit

    args = ("tests.models:ParityNet", "tests.models:TokenData", None, '{"variant": "tied"}', None)
    with pytest.raises(ChunkError, match=r"too small") as refused:
        plan_from_args(*args, {"device_memory_limit": 20_000}, None)
    said = str(refused.value)
    assert "`lightning-chunk plan`" not in said and "(a dry run under it fit)." in said, said
    named = int(re.search(r"it fits under device_memory_limit=(\d+)", said).group(1))
    assert plan_from_args(*args, {"device_memory_limit": named}, None).fits
    fit(ChunkOffloadStrategy(device_memory_limit=named), steps=3, variant="tied")  # trains under it
