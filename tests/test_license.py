"""The LICENSE file is the Apache License 2.0 that pyproject.toml declares, with the appendix's copyright line
filled in."""

import re

from tests.paths import ROOT


def test_license_file_is_the_declared_apache_2_0():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = (\{ text = )?"Apache-2.0"', pyproject, flags=re.M)  # either spelling
    text = (ROOT / "LICENSE").read_text()
    assert text.split("\n", 3)[1:3] == [" " * 33 + "Apache License", " " * 27 + "Version 2.0, January 2004"]
    assert "END OF TERMS AND CONDITIONS" in text and "http://www.apache.org/licenses/LICENSE-2.0" in text
    assert "   Copyright 2026 adaln_lab authors\n" in text and "[yyyy]" not in text
