"""How a CLI run that stops on a user's mistake must end, for the reliability tests."""


def one_line_error(result) -> str:
    """The `Error: ...` line of a click run that failed as a user mistake must: exit status
    1, no traceback (click's SystemExit, not the exception itself), exactly one error line."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, result.output
    return lines[0]
