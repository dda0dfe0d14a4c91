"""Test support shipped with icefloe: the in-process reference channel (``memory``), pytest
fixtures with a real SQLite Iceberg catalog (``fixtures``) and the backend conformance suite
every coordination backend runs against its real server (``conformance``, its tests by
topic in ``rules``)."""
