"""A new store holding some (or all) of another store's samples, with its frozen rows and files.

Used to re-code a store (benchmarks) and to evaluate on a slice of one (quickstart: the
held-out answers that do not loop). Parts keep their indices and source-row ranges, so a
kept sample keeps its part and row; a part with nothing kept is written empty and complete.
"""

from collections.abc import Callable

from dflash_train.store_schema.sample import Sample
from dflash_train.store_schema.store import create_store, open_store


def copy_store(src_url: str, dst_url: str, keep: Callable[[Sample], bool] | None = None
               ) -> tuple[int, int]:
    """Copy the committed samples of `src_url` that `keep` accepts (all by default) into a new
    store at `dst_url`; returns (samples kept, samples seen)."""
    src = open_store(src_url)
    dst = create_store(dst_url, src.meta, shard_tokens=src.shard_tokens)
    rows = src.target_rows()
    dst.write_target_rows(rows["embed_tokens"], rows["lm_head"], rows["final_norm"])
    dst.write_files("target", src.read_files("target"))
    kept = seen = 0
    for part in src.parts():
        writer = dst.part_writer(part.index, part.row_start, part.row_stop)
        for sample in part.iter_samples():
            seen += 1
            if keep is None or keep(sample):
                writer.append(sample)
                kept += 1
        writer.finish()
    dst.write_files("tokenizer", src.read_files("tokenizer"))  # last: marks the copy usable
    return kept, seen
