"""A drafter's config.json with a number of another JSON type (a boolean, a string, a
fraction): refused naming the field, never read as 1, 0 or its integer part (`true` for
mask_token_id loaded a drafter that masks with id 1). Edited by hand, so without the
checksums record (as third-party drafters come)."""

import json

import pytest
from click.testing import CliRunner

from dflash_train.cli import main
from dflash_train.drafter import DrafterError, load_drafter, save_drafter
from tests.drafter.conftest import tiny_drafter
from tests.reliability.cli_errors import one_line_error

CASES = [
    ("dflash_config", "mask_token_id", True, "an integer"),
    ("", "num_hidden_layers", True, "an integer"),
    ("", "hidden_size", "32", "an integer"),
    ("dflash_config", "block_size", 16.5, "an integer"),
    ("", "rms_norm_eps", False, "a number"),
    ("dflash_config", "target_layer_ids", [0, True], "a list of integers"),
]


def _edited(tmp_path, section: str, name: str, value):
    out = save_drafter(tiny_drafter(0), tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    (config[section] if section else config)[name] = value
    (out / "config.json").write_text(json.dumps(config))
    (out / "checksums.json").unlink()
    return out


@pytest.mark.parametrize("section, name, value, kind", CASES, ids=[c[1] for c in CASES])
def test_a_config_number_of_another_type_is_refused_naming_it(tmp_path, section, name, value,
                                                              kind):
    out = _edited(tmp_path, section, name, value)
    scope = f"{section}." if section else ""
    with pytest.raises(DrafterError) as e:
        load_drafter(out)
    assert str(e.value) == f"{out / 'config.json'}: {scope}{name} is {value!r}, not {kind}"
    said = one_line_error(CliRunner().invoke(main, ["export", str(out), str(tmp_path / "x")]))
    assert f"{scope}{name} is {value!r}, not {kind}" in said
    assert not (tmp_path / "x").exists()


def test_the_unedited_config_loads(tmp_path):
    out = _edited(tmp_path, "", "rms_norm_eps", 1e-6)
    assert load_drafter(out).config.rms_norm_eps == 1e-6
