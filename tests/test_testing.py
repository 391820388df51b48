"""adaln_lab.testing.assert_batch_invariant passes an invariant op and fails a planted one."""

import pytest

from adaln_lab.reference import replay
from adaln_lab.testing import assert_batch_invariant


def test_replay_passes():
    report = assert_batch_invariant(replay, quick=True, H=32, D=16)
    assert report["batch_invariant"]


def test_planted_counter_example_fails_with_its_counts():
    def every_row_sees_the_batch_mean(x, *rest):
        return replay(x, *rest) + 2.0 ** -4 * x.mean(dim=0, keepdim=True)

    with pytest.raises(AssertionError, match="not batch-invariant") as error:
        assert_batch_invariant(every_row_sees_the_batch_mean, quick=True, H=32, D=16)
    assert "first_failures" in str(error.value) and "fwd_differ" in str(error.value)
