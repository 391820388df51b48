"""`adaln_lab.harness.progress`: tqdm bars on a terminal, one plain line per finished piece of work in a log."""

import io

from tqdm import tqdm

from adaln_lab.harness import progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_one_plain_line_per_bar(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    monkeypatch.delenv("ADALN_LAB_PROGRESS", raising=False)
    with progress.progress(3, "outer", unit="check", leave=True) as outer:
        for _ in range(3):
            with progress.progress(2, "inner") as inner:
                inner.update(2)
            outer.update()
    assert list(progress.progress(None, "items", unit="item", iterable=["a", "b"])) == ["a", "b"]
    progress.write("[adaln_lab report] a line")
    lines = log.getvalue().splitlines()
    assert [line.split(" in ")[0] for line in lines] == ["inner: 2/2 calls"] * 3 + ["outer: 3/3 checks",
                                                                                     "items: 2/2 items",
                                                                                     "[adaln_lab report] a line"]
    assert "\x1b" not in log.getvalue() and "\r" not in log.getvalue()


def test_a_terminal_gets_tqdm_and_the_variable_forces_either(monkeypatch):
    monkeypatch.delenv("ADALN_LAB_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr", Terminal())
    bar = progress.progress(2, "x")
    assert isinstance(bar, tqdm)
    bar.close()
    monkeypatch.setenv("ADALN_LAB_PROGRESS", "lines")
    assert isinstance(progress.progress(2, "x"), progress.LineProgress)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.setenv("ADALN_LAB_PROGRESS", "bars")
    assert progress.terminal()
