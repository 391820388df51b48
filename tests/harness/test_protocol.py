"""`adaln_lab.harness.protocol`: the seed report's protocol, counted the way the seed report counts it."""

import json

from adaln_lab.harness import invariance
from adaln_lab.harness.protocol import seed_batch_sizes

from ..paths import DATA


def test_seed_batch_sizes_match_the_seed_report():
    seed = json.loads((DATA / "seed_prior_art_b200.json").read_text())
    sweep = seed["results"]["plain"]["rl_kernel"]["batch_invariance"]["batch_size_sweep"]
    assert seed_batch_sizes(2048) == sweep["batch_sizes"]
    per_seed = sum(len(invariance.sweep_positions(b)) for b in sweep["batch_sizes"]) * 8 + 8
    assert 3 * per_seed == sweep["comparisons"]
    starts = sum(len(invariance.sub_batch_starts(131072, s, 1024, 256)) for s in (1, 7, 4097, 32768, 65536))
    assert 2 * starts == seed["results"]["plain"]["rl_kernel"]["batch_invariance"]["full_vs_sub_batches"]["sub_batches"]
