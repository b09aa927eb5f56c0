"""Setting values no run can take, from a TOML file, --set or a flag: infinities in an integer
setting, a seed beyond 64 bits, a --config file that is not UTF-8, a draft vocabulary too
small to learn anything. Each is refused in one line naming the option (and, for a value
that runs but learns nothing, why), before a run directory exists."""

import pytest
from click.testing import CliRunner

from dflash_train.blocks import MAX_SEED
from dflash_train.cli import main
from dflash_train.train.config import load_train_config
from tests.reliability.cli_errors import one_line_error
from tests.reliability.corrupt_store import make_store

TRAIN = ["--layers", "1", "--batch-tokens", "256", "--anchors-per-seq", "8", "--no-progress",
         "--max-steps", "1", "--set", "loader.prefetch_batches=0"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(str(tmp_path_factory.mktemp("store") / "hs.zarr"))


def _train(store, out, *args):
    return CliRunner().invoke(main, ["train", "--store", store, "--out", str(out), *TRAIN,
                                     *args])


@pytest.mark.parametrize("toml, said", [
    ("[optim]\nepochs = inf\n", "--epochs (optim.epochs): expected int, got inf"),
    ("[run]\nlog_every = -inf\n", "run.log_every: expected int, got -inf"),
    ("[run]\ncheckpoint_every = nan\n", "run.checkpoint_every: expected int, got nan"),
    ("[loader]\nshuffle_buffer_tokens = 1e300\n", "loader.shuffle_buffer_tokens: 1000000"),
    (f"[run]\nseed = {2**63}\n", f"--seed (run.seed): {2**63} is beyond a 64-bit integer"),
], ids=["inf", "-inf", "nan", "1e300", "seed 2**63"])
def test_a_toml_value_no_integer_setting_holds_is_one_line(store, tmp_path, toml, said):
    config = tmp_path / "run.toml"
    config.write_text(toml)
    out = tmp_path / "run"
    line = one_line_error(_train(store, out, "--config", str(config)))
    assert said in line, line
    assert not out.exists()


@pytest.mark.parametrize("args", [("--seed", str(2**64)), ("--seed", str(2**63)),
                                  ("--set", f"run.seed={2**70}"), ("--set", f"run.seed={-2**64}")],
                         ids=["--seed 2**64", "--seed 2**63", "--set 2**70", "--set -2**64"])
def test_a_seed_beyond_64_bits_is_one_line_naming_it(store, tmp_path, args):
    out = tmp_path / "run"
    line = one_line_error(_train(store, out, *args))
    assert line.startswith("Error: --seed (run.seed): ") and "64-bit" in line, line
    assert not out.exists()


def test_the_largest_seed_is_taken():
    assert load_train_config(None, {"run.seed": str(MAX_SEED)}).run.seed == MAX_SEED


@pytest.mark.parametrize("command", [["quickstart"], ["eval", "--store", "s", "c"]],
                         ids=["quickstart", "eval"])
@pytest.mark.parametrize("seed", [2**64, -1])
def test_other_commands_refuse_a_seed_out_of_range(command, seed):
    result = CliRunner().invoke(main, [command[0], "--seed", str(seed), *command[1:]])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "'--seed'" in result.output and f"0<=x<={MAX_SEED}" in result.output


def test_a_config_file_that_is_not_utf8_is_one_line_naming_the_byte(store, tmp_path):
    config = tmp_path / "latin1.toml"
    config.write_bytes("[optim]\nlr = 1e-4  # caf\u00e9\n".encode("latin-1"))
    out = tmp_path / "run"
    line = one_line_error(_train(store, out, "--config", str(config)))
    assert f"--config {config}: not UTF-8 text (byte 0xe9 at offset 24)" in line, line
    assert not out.exists()


@pytest.mark.parametrize("size", ["1", "true"])
def test_a_draft_vocabulary_too_small_to_learn_is_refused_saying_why(store, tmp_path, size):
    """Over one id the softmax is 1 whatever the weights: the run trained to loss 0."""
    out = tmp_path / "run"
    line = one_line_error(_train(store, out, "--set", f"model.draft_vocab_size={size}"))
    assert "model.draft_vocab_size" in line and "Traceback" not in line, line
    if size == "1":
        assert "must be at least 2 (over one id the loss is 0 with no gradient: the drafter " \
               "would learn nothing), got 1" in line
    assert not out.exists()
    assert load_train_config(None, {"model.draft_vocab_size": "2"}).model.draft_vocab_size == 2
