"""The data path: decoded records conformed to a table's schema, routed, written as files."""
