"""The package's shape (the project's design: layers whose imports only point down, `LAYERS`): no file of src/adaln_lab
over 400 lines, no import cycle between its modules, and imports that only point down the layers. Every `from` /
`import` of adaln_lab anywhere in a module counts (a function's lazy import too); only `if TYPE_CHECKING:` blocks are
left out (they never run). The checkers also run on planted counter-examples, so a cycle or an edge up a layer cannot
slip past them."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "adaln_lab"
MAX_LINES = 400

# Units (a module's first two dotted names, three under ops) from the bottom layer up: a unit imports only units of
# lower layers (the ops of one layer import none of each other's either).
LAYERS = [
    ("adaln_lab.core", "adaln_lab.reference"),
    ("adaln_lab.ops", "adaln_lab.ops.row_order", "adaln_lab.ops.row_sums"),
    ("adaln_lab.ops.modulation_table", "adaln_lab.ops.modulated_rms_norm", "adaln_lab.ops.gated_residual",
     "adaln_lab.ops.final_adaln_out"),
    ("adaln_lab.ops.gated_residual_norm",),
    ("adaln_lab.ops.block",),
    ("adaln_lab.nn", "adaln_lab.dlpack"),
    ("adaln_lab.harness",),
    ("adaln_lab.lab", "adaln_lab.testing", "adaln_lab.__main__"),
    ("adaln_lab",),
    ("adaln_lab.bench",),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking(test: ast.expr) -> bool:
    """Whether an `if` test is `TYPE_CHECKING` itself (or `typing.TYPE_CHECKING`): never true when the code runs."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported(path: Path, modules: set) -> set:
    """The modules of adaln_lab that `path` imports (a name imported from a package counts as its module where it is
    one), outside `if TYPE_CHECKING:` blocks."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If) and type_checking(n.test)]
    skipped = {id(n) for node in guarded for child in node.body for n in ast.walk(child)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names if target.startswith("adaln_lab") else ():
                out.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("adaln_lab"))
    return out - {name}


def import_graph() -> dict:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported(p, modules) & modules for p in paths}


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        u = stack.pop(); on.discard(u); component.append(u)
                        if u == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif w not in index:
                index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                work.append((w, iter(sorted(graph.get(w, ())))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3] if len(parts) >= 3 and parts[1] == "ops" else parts[:2])


def edges_not_down(graph: dict) -> list:
    """(module, imported module) pairs whose units are not in a lower layer, and modules of no layer."""
    rank = {u: k for k, layer in enumerate(LAYERS) for u in layer}
    bad = []
    for m, targets in graph.items():
        if unit(m) not in rank:
            bad.append((m, "a unit of no layer"))
            continue
        bad += [(m, t) for t in sorted(targets)
                if unit(t) != unit(m) and rank.get(unit(t), len(LAYERS)) >= rank[unit(m)]]
    return bad


def long_files(root: Path) -> dict:
    """{path under root: lines} of the source and text files (.py, .cu, .cuh, .md) over MAX_LINES lines."""
    return {str(p.relative_to(root)): n for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and p.suffix in {".py", ".cu", ".cuh", ".md"} and (n := p.read_text().count("\n")) > MAX_LINES}


def test_no_file_of_the_package_is_over_400_lines(tmp_path):
    assert long_files(PACKAGE) == {}
    (tmp_path / "kernels_cu").mkdir()
    (tmp_path / "kernels_cu" / "big.cu").write_text("//\n" * (MAX_LINES + 1))  # planted: one line too many
    (tmp_path / "ok.py").write_text("#\n" * MAX_LINES)
    assert long_files(tmp_path) == {"kernels_cu/big.cu": MAX_LINES + 1}


def test_no_module_imports_back_into_a_cycle_and_every_import_points_down_a_layer():
    graph = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the walk found the package and its imports
    assert cycles(graph) == []
    assert edges_not_down(graph) == []


def test_the_checkers_catch_a_planted_cycle_and_an_import_up_a_layer():
    graph = import_graph()
    planted = {**graph, "adaln_lab.core.plan": graph["adaln_lab.core.plan"] | {"adaln_lab.nn.exact"},
               "adaln_lab.nn.exact": graph["adaln_lab.nn.exact"] | {"adaln_lab.core.plan"}}
    assert any({"adaln_lab.core.plan", "adaln_lab.nn.exact"} <= set(c) for c in cycles(planted))
    assert ("adaln_lab.core.plan", "adaln_lab.nn.exact") in edges_not_down(planted)
    sideways = {**graph, "adaln_lab.ops.gated_residual.op": {"adaln_lab.ops.modulation_table.exact"}}
    assert edges_not_down(sideways) == [("adaln_lab.ops.gated_residual.op", "adaln_lab.ops.modulation_table.exact")]
    lazy = imported(PACKAGE / "ops" / "final_adaln_out" / "launch.py", set(graph))
    assert "adaln_lab.ops.final_adaln_out.twin.op" in lazy  # a function's own import is an edge
    guards = [ast.parse(code).body[0].test for code in ("if TYPE_CHECKING: pass", "if typing.TYPE_CHECKING: pass",
                                                        "if not TYPE_CHECKING: pass", "if TYPE_CHECKING or X: pass")]
    assert [type_checking(g) for g in guards] == [True, True, False, False]  # only the first two never run
