"""Without diffusers (a plain `pip install -e .`): what needs one of diffusers' classes says which class it wanted
and what needs diffusers, not only "patch / unpatch" (the harness runs without it: test_block_report.py,
test_report.py)."""

import sys

import pytest

pytestmark = pytest.mark.integration  # processes without diffusers


def test_a_diffusers_class_asked_for_without_diffusers_names_itself(monkeypatch):
    from adaln_lab.testing import tiny_h3_model

    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers now raises ImportError
    with pytest.raises(ImportError) as error:
        tiny_h3_model()
    message = str(error.value)
    assert "diffusers' MiniMaxH3Transformer3DModel was asked for, and diffusers is not installed" in message
    assert "testing.tiny_h3_model need diffusers" in message and "pip install 'diffusers>=0.42,<0.43'" in message
