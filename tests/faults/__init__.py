"""The fault suite (``nox -s faults``): exactly-once under crashes, paused leaders and operator
actions, counted by a reader that is not the committer's code. See docs/reliability.md."""
