"""`dflash export` on the command line: what --overwrite may replace, and its wording; --format
gguf and --target-gguf."""

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


def test_gguf_export_on_the_command_line(tmp_path):
    from gguf import GGUFReader

    from .test_gguf_export import gguf_drafter, write_target

    src = save_drafter(gguf_drafter(), tmp_path / "src")
    target = write_target(tmp_path / "target.gguf")
    out = tmp_path / "drafter.gguf"
    result = _export(src, out, "--format", "gguf", "--target-gguf", target)
    assert result.exit_code == 0, result.output
    assert f"-> {out}" in result.output
    assert GGUFReader(out).fields["general.architecture"].contents() == "dflash"
    result = _export(src, out, "--format", "gguf", "--target-gguf", target)
    assert result.exit_code == 1 and "already exists (pass --overwrite" in result.output
    result = _export(src, out, "--format", "gguf", "--target-gguf", target, "--overwrite")
    assert result.exit_code == 0, result.output


def test_gguf_export_of_a_draft_vocabulary_says_llama_cpp_reads_it(tmp_path):
    from .test_gguf_export import gguf_drafter, write_target

    src = save_drafter(gguf_drafter(draft_vocab_size=6), tmp_path / "src")
    result = _export(src, tmp_path / "d.gguf", "--format", "gguf", "--target-gguf",
                     write_target(tmp_path / "target.gguf"))
    assert result.exit_code == 0, result.output
    assert "llama.cpp's DFlash reads" in result.output


def test_gguf_refusals_are_one_line_naming_the_target(tmp_path):
    from .test_gguf_export import gguf_drafter, write_target

    src = save_drafter(gguf_drafter(), tmp_path / "src")
    target = write_target(tmp_path / "target.gguf", width=32)
    result = _export(src, tmp_path / "d.gguf", "--format", "gguf", "--target-gguf", target)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(target) in lines[0] and "embedding_length 32" in lines[0]
    assert not (tmp_path / "d.gguf").exists()


def test_format_and_target_gguf_go_together(tmp_path):
    src = save_drafter(tiny_drafter(0), tmp_path / "src")
    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF")
    result = _export(src, tmp_path / "d.gguf", "--format", "gguf")
    assert result.exit_code == 2 and "--format gguf needs --target-gguf" in result.output
    result = _export(src, tmp_path / "out", "--target-gguf", target)
    assert result.exit_code == 2 and "--target-gguf applies to --format gguf" in result.output
    result = _export(src, tmp_path / "d.gguf")
    assert result.exit_code == 2 and "names a .gguf file but --format is hf" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "target.gguf"]


def test_help_names_every_option():
    result = CliRunner().invoke(export_command, ["--help"])
    assert result.exit_code == 0
    for option in ("--format", "--target-gguf", "--dtype", "--overwrite"):
        assert option in result.output
    assert "llama-server" in result.output
