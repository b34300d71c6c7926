"""The GPT example through its LightningCLI entry point, every config at reduced size; `plan`; bad input."""

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked
from tests.children import child_env, run_with_peak

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "examples/gpt/main.py"
CONFIGS = ROOT / "examples/gpt/configs"
SMALL_DATA = ["--data.max_bytes=300000", "--data.train_windows=2000", "--data.val_windows=64"]


def load_example():
    spec = importlib.util.spec_from_file_location("gpt_main", MAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rows(folder: Path) -> list[dict]:
    return list(csv.DictReader(open(next(folder.rglob("metrics.csv")))))


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_readme_main_job_end_to_end_at_reduced_size(tmp_path):
    cli = load_example().main(
        [
            "fit",
            "--config",
            str(CONFIGS / "cpu_tiny.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=40",
            "--trainer.val_check_interval=20",
            "--trainer.limit_val_batches=4",
            "--trainer.enable_progress_bar=false",
            "--trainer.log_every_n_steps=5",
            "--model.depth=2",
            "--trainer.strategy.init_args.device_memory_limit=14MiB",
            *SMALL_DATA,
        ]
    )
    metrics = rows(tmp_path)
    vals = [float(r["val_loss"]) for r in metrics if r.get("val_loss")]
    assert len(vals) == 2 and vals[1] < vals[0]  # it learns
    for col in (
        "chunk/device_chunk_bytes",
        "chunk/device_chunk_bytes_peak",
        "chunk/host_chunk_bytes",
        "chunk/evictions",
        "chunk/step_time_ms",
    ):
        assert col in metrics[0]
    stats = cli.trainer.strategy.memory_stats()
    assert stats["evictions"] > 0 and stats["device_chunk_bytes_peak"] <= 14 * 2**20
    last = next(tmp_path.rglob("last.ckpt"))
    assert (last / "meta.pt").is_file()  # a sharded checkpoint directory
    pictures = list(tmp_path.rglob("chunk_placement.png"))
    if has_matplotlib():
        assert len(pictures) == 1 and pictures[0].stat().st_size > 10_000
    else:
        assert not pictures


REDUCE_GPU = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.num_nodes=1",
    "--trainer.max_steps=3",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
    "--model.width=64",
    "--model.depth=2",
    "--model.heads=4",
    "--model.context=32",
    "--data.context=32",
    "--data.batch_size=2",
    "--trainer.strategy.init_args.device_memory_limit=16MiB",
    "--trainer.strategy.init_args.process_group_backend=null",
    *SMALL_DATA,
]


@pytest.mark.parametrize("config", ["gpu_offload_1b.yaml", "gpu_multi.yaml"])
def test_gpu_configs_run_on_cpu_at_reduced_size(tmp_path, config):
    cli = load_example().main(
        ["fit", "--config", str(CONFIGS / config), f"--trainer.default_root_dir={tmp_path}", *REDUCE_GPU]
    )
    assert cli.trainer.global_step == 3
    assert cli.model.hparams.activation_checkpointing  # the GPU configs recompute blocks in backward
    assert cli.model.hparams.deferred_init  # and build the model on the meta device, initialised chunk by chunk
    assert cli.trainer.precision == "bf16-mixed"
    assert all(not p.is_meta and p.numel() > 1 for p in cli.model.parameters())  # given back whole after fit


def test_cpu_2ranks_config_through_the_script(tmp_path):
    env = child_env()
    r = subprocess.run(
        [
            sys.executable,
            str(MAIN),
            "fit",
            "--config",
            str(CONFIGS / "cpu_2ranks.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=6",
            "--trainer.limit_val_batches=2",
            "--trainer.val_check_interval=3",
            "--trainer.enable_progress_bar=false",
            "--model.depth=2",
            "--trainer.strategy.init_args.device_memory_limit=14MiB",
            "--trainer.strategy.init_args.checks.collective_timeout_s=60",
            *SMALL_DATA,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    ckpt = next(tmp_path.rglob("last.ckpt"))
    assert {p.name.split("_")[2] for p in ckpt.iterdir() if p.suffix == ".distcp"} == {"0", "1"}  # both ranks wrote


def test_plan_estimate_agrees_with_a_real_run(tmp_path):
    from lightning_chunk.plan import plan_from_args

    overrides = {"device_memory_limit": "14MiB"}
    small = {"max_bytes": 300000, "train_windows": 2000, "val_windows": 64}
    import json

    report = plan_from_args(
        f"{MAIN}:GPT",
        f"{MAIN}:ByteCorpus",
        str(CONFIGS / "cpu_tiny.yaml"),
        json.dumps({"depth": 2}),
        json.dumps(small),
        overrides,
        None,
    )
    assert report.fits and report.chunks >= 4
    cli = load_example().main(
        [
            "fit",
            "--config",
            str(CONFIGS / "cpu_tiny.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=6",
            "--trainer.limit_val_batches=0",
            "--model.depth=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.strategy.init_args.device_memory_limit=14MiB",
            *SMALL_DATA,
        ]
    )
    measured = cli.trainer.strategy.memory_stats()["device_chunk_bytes_peak"]
    assert abs(report.estimated_device_peak_bytes - measured) <= 0.10 * measured, (report.render(), measured)


def test_plan_command_exits_non_zero_with_the_smallest_working_limit():
    r = forked.run(
        [
            sys.executable,
            "-m",
            "lightning_chunk",
            "plan",
            f"{MAIN}:GPT",
            "--data",
            f"{MAIN}:ByteCorpus",
            "--config",
            str(CONFIGS / "cpu_tiny.yaml"),
            "--init-args",
            '{"depth": 2}',
            "--data-args",
            '{"max_bytes": 300000, "train_windows": 2000}',
            "--device-memory-limit",
            "4MiB",
        ],
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 1
    assert "smallest limit that would work is" in r.stderr and "Traceback" not in r.stderr


def test_plan_from_shapes_sizes_a_model_this_machine_could_not_build():
    """A 6.5B GPT (the shapes of a 7B) planned for 8 ranks: 16 bytes a parameter of training state is 96 GiB, more
    than this machine; the plan builds nothing and reports what each rank would hold."""
    r, peak = run_with_peak(
        [
            sys.executable,
            "-m",
            "lightning_chunk",
            "plan",
            f"{MAIN}:GPT",
            "--shapes-only",
            "--ranks",
            "8",
            "--init-args",
            '{"width": 4096, "depth": 32, "heads": 32, "context": 2048, "deferred_init": true}',
            "--device-memory-limit",
            "24GiB",
            "--precision",
            "bf16-mixed",
        ],
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "6,453,600,256 parameters" in r.stdout and "planned for 8 rank(s)" in r.stdout
    per_rank = float(r.stdout.split("shards a rank")[1].split("GiB")[0])
    # bf16-mixed: fp32 master 4 + bf16 copy 2 + fp32 gradient 4 + AdamW 8 = 18 bytes a parameter, over 8 ranks
    assert 18 * 6_453_600_256 / 8 / 2**30 <= per_rank <= 1.05 * 18 * 6_453_600_256 / 8 / 2**30, r.stdout
    assert "fits before activations" in r.stdout
    # nothing was materialised: the child's peak resident set is a small fraction of one rank's shards
    assert peak < 2 * 2**30, peak


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--trainer.strategy.init_args.offload_everything=true"], "offload_everything"),
        (["--trainer.strategy.init_args.device_memory_limit=-5"], "device_memory_limit=-5 must be a positive number"),
        (["--data.corpus=EMPTY"], "holds no files to read"),
    ],
)
def test_bad_cli_input_is_one_clear_message(tmp_path, args, needle):
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [a.replace("EMPTY", str(empty)) for a in args]
    r = forked.run(
        [
            sys.executable,
            str(MAIN),
            "fit",
            "--config",
            str(CONFIGS / "cpu_tiny.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=2",
            *args,
        ],
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode != 0
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_plan_from_shapes_reports_the_disk_tier():
    """The same 6.5B GPT on 8 ranks with 10 GiB of host memory a rank for shards: the rest goes to disk."""
    r = forked.run(
        [
            sys.executable,
            "-m",
            "lightning_chunk",
            "plan",
            f"{MAIN}:GPT",
            "--shapes-only",
            "--ranks",
            "8",
            "--init-args",
            '{"width": 4096, "depth": 32, "heads": 32, "context": 2048, "deferred_init": true}',
            "--placement",
            "host",
            "--host-memory-limit",
            "10GiB",
            "--disk-dir",
            "/nonexistent/never/made",
            "--precision",
            "bf16-mixed",
        ],
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    line = r.stdout.split("placement")[1].splitlines()[0]
    host = float(line.split("GiB on the host")[0].split(",")[-1])
    disk = float(line.split("GiB on disk")[0].split(",")[-1])
    shards = float(r.stdout.split("shards a rank")[1].split("GiB")[0])
    assert host <= 10 and disk >= shards - 10, r.stdout  # what the host cannot hold is on disk
    assert not Path("/nonexistent/never/made").exists()  # planning from shapes touches no directory


def test_disk_config_runs_at_reduced_size(tmp_path):
    scratch = tmp_path / "scratch"
    cli = load_example().main(
        [
            "fit",
            "--config",
            str(CONFIGS / "cpu_disk.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=4",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false",
            "--model.width=128",
            "--model.depth=4",
            "--trainer.strategy.init_args.host_memory_limit=3MiB",
            f"--trainer.strategy.init_args.offload.disk_dir={scratch}",
            *SMALL_DATA,
        ]
    )
    stats = cli.trainer.strategy.memory_stats()
    assert cli.trainer.global_step == 4
    assert stats["disk_shards"] > 0 and stats["disk_chunk_bytes"] > 3 * 2**20 > stats["host_chunk_bytes"]
    assert list(scratch.iterdir()) == []  # scratch removed when fit ended
