"""The shipped example runs through its LightningCLI entry point, at reduced size."""

import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("tiny_train", ROOT / "examples/tiny/train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_offload_config_trains_evicts_and_checkpoints(tmp_path):
    mod = load_example()
    args = ["fit", "--config", str(ROOT / "examples/tiny/offload.yaml"), f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=40", "--trainer.val_check_interval=20", "--trainer.limit_val_batches=4",
            "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=5", "--data.max_bytes=400000",
            "--model.depth=2", "--trainer.strategy.init_args.device_memory_limit=14MiB"]
    cli = mod.main(args)
    rows = list(csv.DictReader(open(next(Path(tmp_path).rglob("metrics.csv")))))
    vals = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert len(vals) == 2 and vals[1] < vals[0]  # it learns
    stats = cli.trainer.strategy.memory_stats()
    assert stats["evictions"] > 0 and stats["device_chunk_bytes_peak"] <= 14 * 2**20
    assert list(Path(tmp_path).rglob("last.ckpt"))


def test_a_corpus_folder_without_text_is_a_clear_error(tmp_path):
    mod = load_example()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no files to read"):
        mod.main(["fit", "--config", str(ROOT / "examples/tiny/offload.yaml"), f"--data.corpus={empty}",
                  f"--trainer.default_root_dir={tmp_path}"])
