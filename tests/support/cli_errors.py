"""What a refused CLI command must print: exactly one stderr line, no traceback (used by the CLI misuse tests)."""


def one_line_error(capsys, *needles: str) -> str:
    """The captured stderr, asserted to be one line without a traceback that contains every needle."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err
