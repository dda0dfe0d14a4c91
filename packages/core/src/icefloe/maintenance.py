"""Keeping a continuously committed table's metadata bounded.

A pipeline commits one snapshot per table every few seconds. Left alone, every commit adds a
manifest that nothing merges and a metadata file that nothing deletes, and every later commit
(and every reader) pays for the history. Iceberg has table properties for each of these; icefloe
sets them on the tables it creates (:data:`RECOMMENDED_TABLE_PROPERTIES`) and ``icefloe doctor``
reports tables that lack them (:func:`table_property_advice`). The committer uses pyiceberg's
merge append, which merges manifests only when ``commit.manifest-merge.enabled`` is true.
"""

from __future__ import annotations

from collections.abc import Mapping

from pyiceberg.table import TableProperties

from icefloe.config import PipelineConfig

#: Table properties icefloe sets on tables it creates, with why (for ``doctor``'s advice).
RECOMMENDED_TABLE_PROPERTIES: dict[str, tuple[str, str]] = {
    TableProperties.MANIFEST_MERGE_ENABLED: (
        "true",
        "every commit adds a manifest; merging them keeps planning and commits from slowing "
        "down with the table's history",
    ),
    TableProperties.METADATA_DELETE_AFTER_COMMIT_ENABLED: (
        "true",
        "every commit writes a metadata file; without this none is ever deleted",
    ),
    TableProperties.METADATA_PREVIOUS_VERSIONS_MAX: (
        "50",
        "how many old metadata files to keep when deleting after commit",
    ),
}


def recommended_properties(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The properties for a new table: icefloe's recommendations, then ``overrides``."""
    props = {key: value for key, (value, _) in RECOMMENDED_TABLE_PROPERTIES.items()}
    props.update(overrides or {})
    return props


def table_property_advice(table: str, properties: Mapping[str, str]) -> list[str]:
    """A warning per recommended property that ``properties`` leaves unset (an explicit other
    value is the owner's choice and is respected)."""
    return [
        f"table '{table}': property {key} is not set; set it to {value} ({why})"
        for key, (value, why) in RECOMMENDED_TABLE_PROPERTIES.items()
        if key not in properties
    ]


def pipeline_table_advice(config: PipelineConfig) -> list[str]:
    """``doctor``'s warnings about the pipeline's existing tables (missing tables are the
    runner's to report: it creates or refuses them)."""
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchTableError

    if not config.tables:
        return []
    try:
        catalog = load_catalog(config.catalog.name, **config.catalog.properties)
    except Exception as exc:  # doctor reports; it does not stop at the first problem
        return [f"catalog '{config.catalog.name}' could not be loaded to check tables: {exc}"]
    warnings: list[str] = []
    for t in config.tables:
        try:
            properties = catalog.load_table(t.name).properties
        except NoSuchTableError:
            continue
        except Exception as exc:
            warnings.append(f"table '{t.name}' could not be checked: {exc}")
            continue
        warnings.extend(table_property_advice(t.name, properties))
    return warnings
