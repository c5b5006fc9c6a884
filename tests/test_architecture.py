"""The dependency direction of docs/architecture.md, checked on the real imports (grimp reads every import
statement of the three packages, function-level ones included)."""

from __future__ import annotations

import copy

import grimp
import networkx as nx
import pytest

#: Packages whose modules import one another in one direction only (no circle of modules, so no import runs back
#: up: issue 33 broke `service.quant`'s circle config -> registry -> quantizers -> config; `service.api`'s serving
#: reads planning, then answers or streaming, never the other way, issue 42).
ACYCLIC = ("service.quant", "service.engine", "service.api")
#: Lower packages that must stay free of HTTP and persistence.
CORE = ("service.engine", "service.artifacts", "service.quant")


def unit(module: str) -> str:
    """The package a module belongs to for the cycle rule: ``service.<sub>``, or the top-level package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "service" and len(parts) > 1 else parts[0]


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def violations(graph: grimp.ImportGraph) -> list[str]:
    """Every broken rule, as ``importer -> imported: rule`` lines (empty when the tree keeps the direction)."""
    found = []
    packages = nx.DiGraph()
    modules = {p: nx.DiGraph() for p in ACYCLIC}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            edge = f"{importer} -> {imported}"
            if _under(importer, *CORE) and _under(imported, "fastapi", "starlette", "service.api", "service.store"):
                found.append(f"{edge}: engine, artifacts and quant import neither FastAPI nor the API or stores")
            if _under(importer, "service.quant") and _under(imported, "service.engine.models"):
                found.append(f"{edge}: quant does not import the models")
            if _under(importer, "service") and _under(imported, "calibration", "evaluation"):
                found.append(f"{edge}: the server imports neither calibration nor evaluation")
            if _under(importer, "calibration", "evaluation") and _under(imported, "service.api"):
                found.append(f"{edge}: offline jobs never import the HTTP layer")
            if _under(importer, "service") and _under(imported, "service") and unit(importer) != unit(imported):
                packages.add_edge(unit(importer), unit(imported))
            for package, edges in modules.items():
                if _under(importer, package) and _under(imported, package) and importer != package:
                    edges.add_edge(importer, imported)
    found += [f"package cycle: {' -> '.join([*c, c[0]])}" for c in nx.simple_cycles(packages)]
    found += [f"module cycle in {p}: {' -> '.join([*c, c[0]])}" for p, g in modules.items() for c in nx.simple_cycles(g)]
    return found


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("service", "calibration", "evaluation", include_external_packages=True)


def test_the_tree_keeps_the_dependency_direction(graph):
    assert violations(graph) == []


@pytest.mark.parametrize(("importer", "imported", "rule"), [
    ("service.quant.base", "service.store.base", "neither FastAPI nor the API or stores"),
    ("service.artifacts.policy", "fastapi", "neither FastAPI"),
    ("service.quant.uniform", "service.engine.models.llada", "quant does not import the models"),
    ("service.runtime.loop", "evaluation.matrix", "neither calibration nor evaluation"),
    ("calibration.job", "service.api.serving", "never import the HTTP layer"),
    ("service.engine.decode", "service.quant.store", "package cycle"),
    # The circle issue 33 removed: the quantizers read their configuration through `QuantSettings`.
    ("service.quant.base", "service.quant.config", "module cycle in service.quant"),
    ("service.quant.plugin", "service.quant.registry", "module cycle in service.quant"),
    # The circle issue 42 removed: models -> reveal -> params -> models (params read the families' cache modes).
    ("service.engine.params", "service.engine.models", "module cycle in service.engine"),
    ("service.engine.protocol", "service.engine.families", "module cycle in service.engine"),
    # Serving's split (issue 42): planning knows nothing of answers, streams or the coordinator.
    ("service.api.planning", "service.api.serving", "module cycle in service.api"),
    ("service.api.streaming", "service.api.serving", "module cycle in service.api"),
])
def test_an_illegal_import_is_caught(graph, importer, imported, rule):
    broken = copy.deepcopy(graph)
    broken.add_import(importer=importer, imported=imported)
    assert any(rule in line for line in violations(broken)), violations(broken)


def _built_in_names() -> set[str]:
    """What names a built-in quantizer: its method name and label, its artifact class and store kind."""
    from service.quant.registry import method, methods

    names = set()
    for name in methods():
        entry = method(name)
        if entry.quantizer is None:  # method none: "none" is a word, not a method's knowledge
            continue
        names |= {entry.name, entry.title}
        if entry.artifact is not None:
            names |= {entry.artifact.__name__, entry.artifact.KIND}
    return names


def test_the_calibration_job_and_cli_name_no_method():
    """Issue 33 item 1: calibration's job and CLI read the registry; each method's fit is its own module, named by
    its plug-in's ``"module:name"`` (checked: a method's knowledge put back into either file fails here)."""
    import re

    from calibration.job import resolve
    from service.quant.registry import calibration_steps
    from tests.support.paths import REPO

    names = _built_in_names()
    assert {"dllm_kvq", "dLLM-KVQ", "kvquant", "KVQuant", "PolicyTable", "KVQuantState", "kivi", "KIVI"} <= names
    # A name inside a longer word is another word (KVQuantConfig, the project's dllm-kvq); joined by _ it is not.
    pattern = re.compile(r"(?<![A-Za-z0-9-])(" + "|".join(map(re.escape, sorted(names))) + r")(?![A-Za-z0-9-])")
    for path in ("calibration/job.py", "calibration/cli.py"):
        text = (REPO / path).read_text()
        assert [m.group(0) for m in pattern.finditer(text)] == [], path
    assert pattern.search("self.summary.kvquant_states[str(bits)]") is not None
    assert pattern.search("KVQuantConfig(method=name); CODE_VERSION = 'dllm-kvq calibration 2'") is None
    steps = {entry.name: entry.calibration for entry in calibration_steps().values()}
    assert {"dllm_kvq", "kvquant"} <= set(steps)
    for name, step in steps.items():
        for ref in (step.fit, step.flags):
            if isinstance(ref, str):
                assert callable(resolve(ref)), ref
                assert ref.split(":")[0] not in ("calibration.job", "calibration.cli"), (name, ref)
