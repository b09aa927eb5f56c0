"""A writer run as its own process, so tests can SIGKILL it mid-write.

python -m tests.store_schema.writer_process URL ROWS: appends rows 0..ROWS-1 (deterministic
per row), printing the number appended after each, then finishes the part.
"""

import sys

import torch

from dflash_train.store_schema import create_store
from tests.store_schema.conftest import make_meta, random_sample

SHARD = 64


def row_sample(row: int):
    return random_sample(1 + (row * 37) % 150, row, torch.Generator().manual_seed(row))


def write_rows(url: str, rows: int) -> None:
    store = create_store(url, make_meta(), shard_tokens=SHARD)
    writer = store.part_writer(0, 0, rows)
    for row in range(writer.next_row, rows):
        writer.append(row_sample(row))
        print(row + 1, flush=True)
    writer.finish()


if __name__ == "__main__":
    write_rows(sys.argv[1], int(sys.argv[2]))
