"""Print every import cycle among the modules of the five packages; exit 1 if there is one.

    python tools/import_cycles.py

A cycle is a strongly connected component of the import graph that grimp builds (the graph
import-linter checks). Every import counts: at module level, inside functions and under
``if TYPE_CHECKING:`` - a cycle that only a deferred import hides still ties the modules
together (neither can be understood, tested or moved without the other). Each cycle is printed
with the imports inside it, so it shows which line to move.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import grimp
import networkx

PACKAGES = ("icefloe", "icefloe_kafka", "icefloe_postgres", "icefloe_redis", "icefloe_spark")


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The components of more than one module, or of one that imports itself, each sorted
    (networkx's strongly connected components of the import graph)."""
    graph = networkx.DiGraph([(a, b) for a, targets in edges.items() for b in targets])
    graph.add_nodes_from(edges)
    self_importing = set(networkx.nodes_with_selfloops(graph))
    return sorted(
        sorted(component)
        for component in networkx.strongly_connected_components(graph)
        if len(component) > 1 or component & self_importing
    )


def import_cycles(*packages: str) -> tuple[list[list[str]], dict[str, set[str]], Any]:
    """The cycles among the modules of ``packages`` (importable), each a sorted list of
    modules, with the graph's edges (module -> modules it imports) and the grimp graph."""
    # exclude_type_checking_imports stays False (its default): those imports count too
    graph = grimp.build_graph(*packages, include_external_packages=False, cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    return strongly_connected(edges), edges, graph


def main() -> int:
    cycles, edges, graph = import_cycles(*PACKAGES)
    for n, component in enumerate(cycles, 1):
        members = set(component)
        print(f"cycle {n}: {len(component)} modules")
        for importer in component:
            for imported in sorted(edges[importer] & members):
                details = graph.get_import_details(importer=importer, imported=imported)
                lines = ", ".join(str(d["line_number"]) for d in details)
                print(f"  {importer} -> {imported}  (line {lines})")
    print(f"{len(cycles)} import cycle(s) among {len(edges)} modules")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
