"""The host A/B's verdict (adaln_lab.bench.host_ab_summary): each tree against the identity floor of its own round,
on a made-up file whose figures are known, on a planted slower tree, and on the committed H100 file."""

import pytest

from adaln_lab.bench import host_ab_summary
from adaln_lab.bench.host_ab_summary import rows, table

from ..paths import ROOT

EVIDENCE = ROOT / "bench" / "results" / "h100" / "host_ab_bb26dd2.txt"


def _round(commit, norm_out, floor, forward):
    return (f"== TREE {commit}\n"
            f"final_adaln_out adaln_lab: host fwd+bwd {norm_out} us at 4097 rows\n"
            f"final_adaln_out diffusers replay: host fwd+bwd 999 us at 4097 rows\n"
            f"final_adaln_out identity floor: host fwd+bwd {floor} us at 4097 rows\n"
            f"final_adaln_out adaln_lab: host fwd {forward} us at 4097 rows\n")


def _file(this_values):
    """Three rounds; the base's figure is twice its round's floor, this tree's `this_values` over a floor of 100."""
    base = [(200, 100, 40), (400, 200, 80), (300, 150, 60)]
    return "".join(_round("aaaaaaa", *b) + _round("bbbbbbb", v, 100, 30) for b, v in zip(base, this_values))


def test_a_tree_on_a_faster_round_is_judged_by_its_ratio_to_that_rounds_floor():
    (wall,) = [r for r in rows(_file([190, 210, 200])) if r["phase"] == "fwd+bwd"]
    assert wall["base"]["rounds"] == [200, 400, 300] and wall["base"]["median"] == 300
    assert wall["base"]["ratio"] == 2.0 and wall["this"]["ratio"] == 2.0 and wall["no_slower"]
    (forward,) = [r for r in rows(_file([190, 210, 200])) if r["phase"] == "fwd"]
    assert forward["base"]["ratio"] == 0.4 and forward["this"]["ratio"] == 0.3 and forward["no_slower"]


def test_a_planted_slower_tree_is_called_slower_although_its_raw_median_is_lower():
    (wall,) = [r for r in rows(_file([210, 220, 230])) if r["phase"] == "fwd+bwd"]
    assert wall["this"]["median"] < wall["base"]["median"] and not wall["no_slower"]
    assert "SLOWER" in table(_file([210, 220, 230]))


def test_a_file_of_one_tree_is_refused():
    with pytest.raises(ValueError, match="expected two trees"):
        rows(_round("aaaaaaa", 200, 100, 40) * 3)


@pytest.mark.skipif(not EVIDENCE.is_file(), reason=f"{EVIDENCE} is not committed")
def test_the_committed_h100_file(capsys):
    found = {(r["step"], r["clock"], r["phase"]): r for r in rows(EVIDENCE.read_text())}
    norm_out = found[("final_adaln_out", "wall", "fwd+bwd")]
    assert (norm_out["base"]["commit"], norm_out["this"]["commit"]) == ("8c7a04a", "bb26dd2")
    assert (norm_out["base"]["median"], norm_out["this"]["median"]) == (369, 495)
    assert round(norm_out["base"]["ratio"], 2) == 1.64 and round(norm_out["this"]["ratio"], 2) == 1.74
    assert not norm_out["no_slower"] and found[("block", "wall", "fwd+bwd")]["no_slower"]
    assert host_ab_summary.main([str(EVIDENCE)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 8
