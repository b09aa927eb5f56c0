"""`dflash export`: a training checkpoint (or a run directory: its best checkpoint) -> the
directory vLLM / SGLang / z-lab load, or the one GGUF file llama.cpp loads (`--format gguf`)."""

from pathlib import Path

import click

from dflash_train.drafter.checkpoint import (
    check_output_dir,
    export_checkpoint,
    resolve_drafter_dir,
)
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.gguf_export import export_gguf
from dflash_train.drafter.hf_config import read_drafter_config
from dflash_train.errors import reported_as_one_line
from dflash_train.run_reader import is_run_dir, run_checkpoint

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "keep": None}
FORMATS = ("hf", "gguf")


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="hf", show_default=True,
              help="hf: a drafter directory (config.json + model.safetensors) for vLLM, SGLang "
                   "and z-lab's code; gguf: one OUT.gguf file for llama.cpp (llama-server -m "
                   "TARGET.gguf -md OUT.gguf --spec-type draft-dflash), needs --target-gguf.")
@click.option("--target-gguf", type=click.Path(exists=True, dir_okay=False),
              help="With --format gguf (required there, refused otherwise): the target's GGUF "
                   "file llama-server loads with -m. The export copies its tokenizer and "
                   "refuses a drafter that does not fit it (width, layers, vocabulary, "
                   "architecture).")
@click.option("--dtype", type=click.Choice(list(_DTYPES)), default="bfloat16", show_default=True,
              help="Weight dtype of the export; keep = as trained. In a GGUF, norms and "
                   "convolution kernels stay float32, as llama.cpp's converter writes them.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it is a previous export: an empty directory or one of "
                   "config.json, model.safetensors, checksums.json only (hf), a DFlash GGUF "
                   "file (gguf); anything else is refused.")
def export_command(checkpoint: str, out: str, fmt: str, target_gguf: str | None, dtype: str,
                   overwrite: bool) -> None:
    """Write CHECKPOINT (a training checkpoint, a drafter dir, or a run directory: its best
    checkpoint on validation, else its newest) as a DFlash drafter at OUT: a directory
    (config.json + model.safetensors) that vLLM, SGLang and z-lab's code load, or with
    --format gguf one GGUF file llama.cpp loads. A drafter with a draft vocabulary
    (model.draft_vocab_size) is served by vLLM and llama.cpp only."""
    from dflash_train.dtypes import torch_dtype as named_dtype

    check_format_options(fmt, out, target_gguf)
    name = _DTYPES[dtype]
    torch_dtype = named_dtype(name) if name else None
    with reported_as_one_line():
        if is_run_dir(checkpoint):
            chosen, why = run_checkpoint(checkpoint)
            click.echo(f"{checkpoint}: exporting {why}, {chosen}")
            checkpoint = str(chosen)
        if fmt == "gguf":
            written = export_gguf(checkpoint, out, target_gguf, dtype=torch_dtype,
                                  overwrite=overwrite, flag="--overwrite")
        else:
            check_output_dir(out, overwrite, flag="--overwrite")  # before loading anything
            written = export_checkpoint(checkpoint, out, overwrite=overwrite, dtype=torch_dtype)
    click.echo(f"exported {checkpoint} -> {written}")
    # the checkpoint's config: a GGUF has no config.json to read back
    saved = read_drafter_config(resolve_drafter_dir(checkpoint, checked_whole=True))
    note = serving_note(saved, fmt)
    if note:
        click.echo(note)


def check_format_options(fmt: str, out: str, target_gguf: str | None) -> None:
    """--target-gguf goes with --format gguf and only with it; an OUT named *.gguf with the
    default format would be a directory of that name, so it is refused too."""
    if fmt == "gguf" and target_gguf is None:
        raise click.UsageError("--format gguf needs --target-gguf TARGET.gguf (the target "
                               "llama-server loads with -m): the drafter's GGUF carries its "
                               "tokenizer")
    if fmt != "gguf" and target_gguf is not None:
        raise click.UsageError(f"--target-gguf applies to --format gguf only, not --format {fmt}")
    if fmt == "hf" and Path(out).suffix.lower() == ".gguf":
        raise click.UsageError(f"OUT {out} names a .gguf file but --format is hf (a "
                               "directory); pass --format gguf --target-gguf TARGET.gguf")


def serving_note(config: DrafterConfig, fmt: str = "hf") -> str | None:
    """Which engines serve a drafter's draft vocabulary (None: it has none)."""
    if config.draft_vocab_size is None:
        return None
    if fmt == "gguf":
        return (f"note: this drafter drafts over {config.draft_vocab_size:,} of the target's "
                f"{config.vocab_size:,} ids; the GGUF ships their rows (output.weight) and "
                "target ids (d2t), which llama.cpp's DFlash reads")
    return (f"note: this drafter drafts over {config.draft_vocab_size:,} of the target's "
            f"{config.vocab_size:,} ids (d2t + its own lm_head rows). vLLM serves it as "
            "trained; SGLang and z-lab's dflash package ignore d2t, so do not serve it there")
