"""`extract --regenerate --server URL` against servers that misbehave: a URL that is not one,
answers that are not HTTP or stop short, a connection closed or held silent, a server of
another model. Each ends in one line naming the URL (and the row, once one is asked), a
non-zero exit, and nothing written that a later step would take for the target's answers."""

import pytest
from click.testing import CliRunner

from dflash_train.extract import server_generate
from dflash_train.extract.command import extract
from dflash_train.extract.errors import ExtractError
from dflash_train.extract.server_generate import Ask, Server, server_continuations
from dflash_train.store_schema import open_store
from dflash_train.store_schema.info import top1_agreement
from tests.reliability.cli_errors import one_line_error
from tests.reliability.extract_support import NUM_ROWS, cli_args, shared_inputs
from tests.reliability.fake_server import FaultyServer

NEW = 8
"""Tokens generated per prompt: 14 rows x 8 = 112 answer tokens, enough to judge agreement."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return shared_inputs(tmp_path_factory.getbasetemp())


def _extract(inputs, out, *server_args: str, **settings):
    model, data = inputs
    args = cli_args(model, data, str(out), **settings) + [
        "--regenerate", "--max-new-tokens", str(NEW), *server_args]
    return CliRunner().invoke(extract, args)


@pytest.mark.parametrize("url", ["http://127.0.0.1:abc", "http://[::1", "127.0.0.1:8000",
                                 "ftp://127.0.0.1:8000"])
def test_a_malformed_server_url_is_one_line_naming_it_and_nothing_is_written(inputs, tmp_path,
                                                                             url):
    out = tmp_path / "hs.zarr"
    line = one_line_error(_extract(inputs, out, "--server", url))
    assert f"--server {url!r} is not a server URL" in line and "http://127.0.0.1:8000" in line
    assert not out.exists()


@pytest.mark.parametrize("fault, why", [
    ("not_http", "did not answer in HTTP"),
    ("cut_short", "cut its answer short"),
    ("close", "closed the connection without answering"),
])
def test_every_transport_failure_names_the_row_and_the_server(fault, why):
    with FaultyServer("m", fault) as fake:
        with pytest.raises(ExtractError) as e:
            server_continuations([Server(fake.url, "m", None)], [(5, [2, 3])],
                                 Ask(4, [3], 300), in_flight=1)
    assert str(e.value).startswith(f"row 5: --server {fake.url}: ")
    assert why in str(e.value) and "re-run to resume" in str(e.value)


def test_an_answer_that_is_not_http_stops_extract_in_one_line(inputs, tmp_path):
    out = tmp_path / "hs.zarr"
    with FaultyServer(inputs[0], "not_http") as fake:
        line = one_line_error(_extract(inputs, out, "--server", fake.url))
    assert f"--server {fake.url}: " in line and "did not answer in HTTP" in line
    assert "row " in line
    assert not any(p.num_samples for p in open_store(str(out)).parts())


def test_a_silent_server_is_named_while_waiting_and_given_up_on_after_the_timeout():
    notes: list[str] = []
    with FaultyServer("m", "silent") as fake:
        with pytest.raises(ExtractError, match=rf"row 5: --server {fake.url}: no answer from "
                                               r".* within 1 s \(--server-timeout\)"):
            server_continuations([Server(fake.url, "m", None)], [(5, [2, 3])],
                                 Ask(4, [3], 300), in_flight=1, timeout=1.0,
                                 note=notes.append)
    assert len(notes) == 1, notes  # named once, not once per tick
    assert notes[0].startswith(f"waiting on --server {fake.url} for row 5")
    assert "gives up after 1 s" in notes[0]


def test_a_server_answering_steadily_is_never_named_a_silent_one_once(monkeypatch):
    """The waiting line is for silence, not for a busy server: it names the oldest request
    only once no answer at all came for slow_s, and once per silence (a clock of our own)."""
    now = [0.0]
    monkeypatch.setattr(server_generate.time, "monotonic", lambda: now[0])
    notes: list[str] = []
    waiting = server_generate._InFlight(slow_s=10, timeout=40, note=notes.append)

    def at(t: float, *calls) -> None:
        now[0] = t
        for call in calls:
            call()

    at(0, lambda: waiting.start(1, "u1"), lambda: waiting.start(2, "u2"))
    at(8, lambda: waiting.end(1))
    at(15, waiting.name_stall)  # row 2 is 15 s old, but an answer came 7 s ago
    assert notes == []
    at(19, waiting.name_stall, waiting.name_stall)
    at(25, waiting.name_stall)
    assert len(notes) == 1 and notes[0].startswith("waiting on --server u2 for row 2 (19 s")
    at(26, lambda: waiting.end(2), lambda: waiting.start(3, "u1"))
    at(37, waiting.name_stall)
    assert len(notes) == 2 and "for row 3 (11 s so far" in notes[1]


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_server_timeout_is_refused_unless_finite_and_positive(inputs, tmp_path, value):
    out = tmp_path / "hs.zarr"
    line = one_line_error(_extract(inputs, out, "--server", "http://127.0.0.1:9",
                                    "--server-timeout", value))
    assert "--server-timeout must be a finite number of seconds > 0" in line
    assert not out.exists()


def test_a_server_of_another_model_is_refused_by_how_rarely_it_agrees(inputs, tmp_path):
    """The server's card names --model, so only the forward can tell: its answers are ids
    the target's own top-1 rarely picks."""
    out = tmp_path / "hs.zarr"
    with FaultyServer(inputs[0], "other_model") as fake:
        line = one_line_error(_extract(inputs, out, "--server", fake.url))
    assert fake.completions == NUM_ROWS
    agree, total = top1_agreement(open_store(str(out)))  # what store info would report
    assert total == NUM_ROWS * NEW and agree / total < 0.5
    assert f"{agree:,} of {total:,} answer tokens ({agree / total:.2%})" in line
    assert "another model than --model" in line and f"{out} holds its answers" in line


def test_another_models_answers_are_refused_after_the_first_part_not_the_whole_run(inputs,
                                                                                   tmp_path):
    """Parts of 10 and 4 rows: the first part's 80 answer tokens are enough to judge."""
    out = tmp_path / "hs.zarr"
    with FaultyServer(inputs[0], "other_model") as fake:
        line = one_line_error(_extract(inputs, out, "--server", fake.url, rows_per_part=10))
    assert "another model than --model" in line
    assert fake.completions == 10  # the second part's 4 prompts were never sent
    assert [p.num_samples for p in open_store(str(out)).parts()] == [10]
