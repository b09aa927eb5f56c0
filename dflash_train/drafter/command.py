"""`dflash export`: a training checkpoint -> the directory serving engines load."""

import click

from dflash_train.drafter.checkpoint import check_output_dir, export_checkpoint
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.errors import DrafterError
from dflash_train.drafter.hf_config import read_config

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "keep": None}


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(list(_DTYPES)), default="bfloat16", show_default=True,
              help="Weight dtype of the export; keep = as trained.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT_DIR if it is empty or a previous export (config.json, "
                   "model.safetensors, checksums.json only); any other directory is refused.")
def export_command(checkpoint: str, out_dir: str, dtype: str, overwrite: bool) -> None:
    """Write CHECKPOINT (a training checkpoint or drafter dir) as a DFlash drafter directory
    (config.json + model.safetensors) that vLLM, SGLang and z-lab's code load; one with a
    draft vocabulary (model.draft_vocab_size) is served by vLLM only."""
    import torch

    try:
        check_output_dir(out_dir, overwrite, flag="--overwrite")  # before loading anything
        name = _DTYPES[dtype]
        out = export_checkpoint(checkpoint, out_dir, overwrite=overwrite,
                                dtype=getattr(torch, name) if name else None)
    except DrafterError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"exported {checkpoint} -> {out}")
    note = serving_note(read_config(out))
    if note:
        click.echo(note)


def serving_note(config: DrafterConfig) -> str | None:
    """Which engines serve a drafter's draft vocabulary (None: it has none)."""
    if config.draft_vocab_size is None:
        return None
    return (f"note: this drafter drafts over {config.draft_vocab_size:,} of the target's "
            f"{config.vocab_size:,} ids (d2t + its own lm_head rows). vLLM serves it as "
            "trained; SGLang and z-lab's dflash package ignore d2t, so do not serve it there")
