"""Every stage's error type is a DflashError, so each command reports it as one line."""

import click
import pytest

from dflash_train.blocks import BlockError
from dflash_train.drafter import DrafterError
from dflash_train.errors import DflashError, reported_as_one_line
from dflash_train.evaluate.errors import EvalError
from dflash_train.extract.errors import ExtractError
from dflash_train.store_schema import StoreError
from dflash_train.train.errors import TrainError

STAGE_ERRORS = [BlockError, DrafterError, EvalError, ExtractError, StoreError, TrainError]


@pytest.mark.parametrize("error", STAGE_ERRORS, ids=lambda e: e.__name__)
def test_every_stage_error_becomes_one_click_line(error):
    with pytest.raises(click.ClickException) as caught:
        with reported_as_one_line():
            raise error("part 3 of x.zarr is torn")
    assert caught.value.format_message() == "part 3 of x.zarr is torn"
    assert caught.value.exit_code == 1


def test_a_bug_is_not_dressed_as_a_user_error():
    with pytest.raises(KeyError):
        with reported_as_one_line():
            raise KeyError("a bug keeps its traceback")


def test_block_error_stays_a_value_error_for_callers_that_catch_one():
    assert issubclass(BlockError, ValueError) and issubclass(BlockError, DflashError)
