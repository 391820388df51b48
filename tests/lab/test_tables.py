"""`adaln_lab.lab.tables` prints the committed report's own figures (bench/results/<machine>/report.json; skipped until
it is refilled from a GPU run)."""

from adaln_lab.lab import evidence, tables

from ..paths import EVIDENCE, needs_evidence


@needs_evidence("report.json")
def test_tables_print_the_report_figures():
    report = evidence.load_report(EVIDENCE)
    text = tables.report_errors(report)
    a = report["results"]["plain"]["adaln_lab"]["accuracy_latency"]["4097"]
    assert f"| adaln_lab | 4097 | {tables.fmt(a['fwd_rel_err'])} |" in text
    assert tables.pct(a["grad_correctly_rounded"]["b"]) in text
    assert tables.us(a["fwd_bwd_us_graph"]) in tables.report_latency(report)
    sub = report["results"]["plain"]["torch_compile"]["batch_invariance"]["full_vs_sub_batches"]
    assert "| torch_compile | " in tables.invariance(report)
    assert f" | {sub['fwd_differ']} / {sub['rowgrad_differ']} | " in tables.invariance(report)  # its sub-batch rows
