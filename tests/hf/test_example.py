"""The Hugging Face example through its LightningCLI entry point, every config at reduced size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from lightning_chunk.hf import export_hf  # noqa: E402
from tests import forked  # noqa: E402
from tests.children import child_env  # noqa: E402
from tests.hf.models import ROOT, load_example, save_pretrained  # noqa: E402
from tests.integration.test_examples import rows  # noqa: E402

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's

MAIN = ROOT / "examples/hf/main.py"
CONFIGS = ROOT / "examples/hf/configs"
SMALL_DATA = ["--data.max_bytes=300000", "--data.train_windows=2000", "--data.val_windows=64"]


def test_quick_start_learns_evicts_and_exports_for_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    cli = load_example().main(
        [
            "fit",
            "--config",
            str(CONFIGS / "cpu_tiny_llama.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=40",
            "--trainer.val_check_interval=20",
            "--trainer.limit_val_batches=4",
            "--trainer.enable_progress_bar=false",
            "--data.context=64",
            "--model.config.num_hidden_layers=2",
            "--trainer.strategy.init_args.device_memory_limit=24MiB",
            *SMALL_DATA,
        ]
    )
    vals = [float(r["val_loss"]) for r in rows(tmp_path) if r.get("val_loss")]
    assert len(vals) == 2 and vals[1] < vals[0]  # it learns
    stats = cli.trainer.strategy.memory_stats()
    assert stats["evictions"] > 0 and stats["device_chunk_bytes_peak"] <= 24 * 2**20
    ckpt = next(tmp_path.rglob("last.ckpt"))
    loaded = AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "tiny-llama", progress=False))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, cli.model(x), rtol=0, atol=0)


def tiny_tokenizer(path: Path) -> Path:
    """A byte-level BPE of 300 tokens (256 bytes, merges, one special token) trained here on a little of the standard
    library: what a real model's directory holds, without a download."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = Path(sysconfig.get_paths()["stdlib"], "os.py").read_text()
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    return path


@pytest.mark.parametrize("config,kind", [("gpu_opt_1.3b.yaml", "opt"), ("gpu_llama_7b.yaml", "llama")])
def test_gpu_configs_run_on_cpu_at_reduced_size(tmp_path, config, kind):
    """The real models' configs with a tiny model of the same architecture in the pretrained directory and a
    tokenizer built here: weights streamed into the shards, HF gradient checkpointing, bf16-mixed."""
    pre = save_pretrained(kind, tmp_path / "pre", vocab_size=320)
    tok = tiny_tokenizer(tmp_path / "pre")
    cli = load_example().main(
        [
            "fit",
            "--config",
            str(CONFIGS / config),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=3",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false",
            f"--model.pretrained={pre}",
            f"--data.tokenizer={tok}",
            "--data.context=32",
            "--data.batch_size=2",
            "--trainer.strategy.init_args.device_memory_limit=4MiB",
            *SMALL_DATA,
        ]
    )
    assert cli.trainer.global_step == 3 and cli.trainer.precision == "bf16-mixed"
    assert cli.model.hf_model.is_gradient_checkpointing
    assert cli.trainer.strategy.weights == str(pre)
    assert cli.datamodule.vocab_size == 300 and 256 <= int(cli.datamodule.train_set.tokens.max()) < 300  # merges used


def test_two_ranks_config_through_the_script(tmp_path):
    env = child_env()
    r = subprocess.run(
        [
            sys.executable,
            str(MAIN),
            "fit",
            "--config",
            str(CONFIGS / "cpu_2ranks_opt.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=6",
            "--trainer.limit_val_batches=2",
            "--trainer.val_check_interval=3",
            "--trainer.enable_progress_bar=false",
            "--model.config.num_hidden_layers=2",
            "--data.context=64",
            "--trainer.strategy.init_args.device_memory_limit=24MiB",
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


def test_bad_cli_input_is_one_clear_message(tmp_path):
    r = forked.run(
        [
            sys.executable,
            str(MAIN),
            "fit",
            "--config",
            str(CONFIGS / "cpu_tiny_llama.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=2",
            *SMALL_DATA,
            "--model.config=null",
        ],
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode != 0
    assert "model.pretrained (a save_pretrained directory) or model.config with a 'model_type'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model.pretrained=EMPTY"], "is not a save_pretrained directory (no config.json)"),
        (["--model.config.vocab_size=100"], "the data has 256 token ids but the model's vocab_size is 100"),
        (["--data.context=200"], "data.context=200 is longer than the model's 128 positions"),
    ],
)
def test_bad_model_input_names_the_value(tmp_path, args, needle):
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [a.replace("EMPTY", str(empty)) for a in args]
    with pytest.raises(ValueError) as e:
        load_example().main(
            [
                "fit",
                "--config",
                str(CONFIGS / "cpu_tiny_llama.yaml"),
                f"--trainer.default_root_dir={tmp_path}",
                "--trainer.max_steps=2",
                "--trainer.enable_progress_bar=false",
                *SMALL_DATA,
                *args,
            ]
        )
    assert needle in str(e.value)
