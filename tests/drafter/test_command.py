"""`dflash export` on the command line: what --overwrite may replace, and its wording."""

from click.testing import CliRunner

from dflash_train.drafter import load_drafter, save_drafter
from dflash_train.drafter.command import export_command

from .conftest import tiny_drafter


def _export(*args):
    return CliRunner().invoke(export_command, [str(a) for a in args], catch_exceptions=False)


def test_existing_out_dir_is_refused_with_the_cli_flag_named(tmp_path):
    src = save_drafter(tiny_drafter(0), tmp_path / "src")
    out = save_drafter(tiny_drafter(1), tmp_path / "out")
    result = _export(src, out)
    assert result.exit_code == 1
    assert f"{out}: already exists (pass --overwrite" in result.output
    assert "overwrite=True" not in result.output
    result = _export(src, out, "--overwrite", "--dtype", "keep")
    assert result.exit_code == 0, result.output
    assert load_drafter(out).config == tiny_drafter(0).config


def test_overwrite_of_a_folder_of_user_files_is_refused_and_keeps_them(tmp_path):
    src = save_drafter(tiny_drafter(0), tmp_path / "src")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.csv").write_text("1,2,3\n")
    (mine / "sub").mkdir()
    result = _export(src, mine, "--overwrite")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(mine) in lines[0]
    assert "data.csv" in lines[0] and "sub" in lines[0]
    assert (mine / "data.csv").read_text() == "1,2,3\n" and (mine / "sub").is_dir()
