"""The Iceberg side of a cycle: screening, deduplication and the fenced, idempotent commit."""
