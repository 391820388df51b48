"""Tests of the evidence tooling: the runner (adaln_lab.bench), bench/NOTES.md, bench/README.md and bench/tools/."""
