"""Multi-table fan-out (icefloe.records.routing)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from icefloe.config import TableConfig
from icefloe.errors import ConfigError
from icefloe.records.routing import route, route_groups, route_masks, unrouted_problem


def test_routes_by_field_value_and_unrouted_tables_get_everything() -> None:
    data = pa.table({"type": ["click", "view", None, "buy", "click"], "n": [1, 2, 3, 4, 5]})
    tables = [
        TableConfig(name="db.clicks", route_field="type", route_values=["click"]),
        TableConfig(name="db.sales", route_field="type", route_values=["buy", "refund"]),
        TableConfig(name="db.all"),
    ]
    out = route(data, tables)
    assert out["db.clicks"].column("n").to_pylist() == [1, 5]
    assert out["db.sales"].column("n").to_pylist() == [4]
    assert out["db.all"] is data  # no copy when every row goes
    assert route_masks(data, tables)["db.all"] is None


def test_values_compare_as_text_and_dotted_paths_reach_into_structs() -> None:
    data = pa.table(
        {
            "kind": pa.array([1, 2, 1], pa.int64()),
            "meta": pa.array([{"src": "web"}, {"src": "app"}, None]),
        }
    )
    out = route(
        data,
        [
            TableConfig(name="db.one", route_field="kind", route_values=["1"]),
            TableConfig(name="db.web", route_field="meta.src", route_values=["web"]),
        ],
    )
    assert out["db.one"].num_rows == 2
    assert out["db.web"].column("kind").to_pylist() == [1]


def test_configuration_errors_name_the_key() -> None:
    data = pa.table({"type": ["a"]})
    with pytest.raises(ConfigError, match=r"tables\[0\]\.route_field"):
        route(data, [TableConfig(name="db.t", route_field="kind", route_values=["a"])])
    with pytest.raises(ConfigError, match=r"tables\[1\]\.route_values"):
        route(data, [TableConfig(name="db.a"), TableConfig(name="db.t", route_field="type")])


@given(
    st.lists(st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d"])), max_size=40),
    st.lists(st.sets(st.sampled_from(["a", "b", "c", "d"]), min_size=1), min_size=1, max_size=4),
)
def test_each_row_goes_to_exactly_the_tables_that_list_its_value(
    kinds: list[str | None], routes: list[set[str]]
) -> None:
    data = pa.table({"kind": pa.array(kinds, pa.string()), "i": list(range(len(kinds)))})
    tables = [
        TableConfig(name=f"db.t{i}", route_field="kind", route_values=sorted(values))
        for i, values in enumerate(routes)
    ]
    out = route(data, tables)
    for i, values in enumerate(routes):
        expected = [j for j, k in enumerate(kinds) if k in values]
        assert out[f"db.t{i}"].column("i").to_pylist() == expected


@given(
    st.lists(st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d", "e"])), max_size=40),
    st.lists(st.sampled_from(range(4)), min_size=4, max_size=4),
)
def test_grouped_routing_takes_the_rows_the_masks_take(
    kinds: list[str | None], owners: list[int]
) -> None:
    """A fan-out by exact values ("a".."d" each listed by one table, "e" by none) grouped in
    one pass gives each table the rows, in record order, and the first unrouted row that the
    masks give."""
    data = pa.table({"kind": pa.array(kinds, pa.string()), "i": list(range(len(kinds)))})
    values: dict[int, list[str]] = {}
    for value, owner in zip("abcd", owners, strict=True):
        values.setdefault(owner, []).append(value)
    tables = [
        TableConfig(name=f"db.t{i}", route_field="kind", route_values=vs)
        for i, vs in sorted(values.items())
    ]
    groups = route_groups(data, tables)
    assert groups is not None
    grouped = data.take(groups.order)
    masks = route_masks(data, tables)
    for t in tables:
        start, n = groups.spans[t.name]
        mask = masks[t.name]
        assert mask is not None
        want = data.filter(mask).column("i").to_pylist()
        assert grouped.slice(start, n).column("i").to_pylist() == want
    unrouted = unrouted_problem(data, masks, tables)
    assert groups.unrouted == (-1 if unrouted is None else unrouted[0])


def test_grouped_routing_is_only_for_one_table_per_value() -> None:
    data = pa.table({"kind": ["a", "b"], "type": ["x", "y"]})

    def table(name: str, **route: Any) -> TableConfig:
        return TableConfig(name=name, **route)

    a = table("db.a", route_field="kind", route_values=["a"])
    assert route_groups(data, [a, table("db.b", route_field="kind", route_values=["b"])])
    for other in (
        table("db.all"),  # takes every row
        table("db.b", route_field="kind", route_values=["a", "b"]),  # "a" goes to both
        table("db.b", route_field="kind", route_regex="b"),
        table("db.b", route_field="type", route_values=["y"]),
        table("db.b", route_field="missing", route_values=["b"]),
    ):
        assert route_groups(data, [a, other]) is None
