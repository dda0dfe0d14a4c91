"""The ``icefloe`` streaming sink: write tasks, the tables they write, publishing batches."""
