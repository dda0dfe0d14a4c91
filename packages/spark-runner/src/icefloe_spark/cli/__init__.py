"""``icefloe run`` and ``icefloe demo``, the live view, and the demos."""
