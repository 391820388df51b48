"""`python -m adaln_lab.lab.notebooks --help`: it says that nothing is written without --write (no "in place")."""

import pytest

from adaln_lab.lab import notebooks

pytestmark = pytest.mark.integration  # the notebook runner's processes


def test_help_says_what_write_does_and_that_nothing_is_written_without_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        notebooks.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "in place" not in text
    assert "Without `--write` nothing is written" in text and "ADALN_LAB_EVIDENCE_DIR" in text
