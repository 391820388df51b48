"""The measuring lab behind the notebooks: error and latency analysis, the invariance walkthrough.

    python -m adaln_lab.lab --out DIR [--quick]    (writes DIR/lab_errors.json, lab_invariance.json,
                                                    lab_latency.json; progress on stderr, what it
                                                    wrote and its key figures on stdout)
    python -m adaln_lab.lab table DIR               (those key figures again, from the files)
    python -m adaln_lab.lab.notebooks [--write]     (executes notebooks/*.ipynb; MODE auto)

Modules: `errors` (goldens, rounding attribution, ulps, gradient error against rows, run-to-run
spread), `latency` (rows sweep of graph / eager / host time against the floors, per-kernel
roofline), `walkthrough` (the invariance checks step by step, planted counter-examples), and
`evidence` (MODE of a notebook: measure now, or read the committed GPU evidence), `tables`
(the notebooks' markdown tables), `summary` (the key figures of lab files), `figures` and
`notebooks` (their runner).
"""
