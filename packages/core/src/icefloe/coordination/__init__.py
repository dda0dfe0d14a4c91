"""The coordinator's parts, one module per role; :mod:`icefloe.coordination.coordinator` assembles
them.

* :mod:`.settings` - settings, hooks and cycle results (the public data types);
* :mod:`.leadership` - the lease, its renewal and the fencing token;
* :mod:`.reading` - reading events: writers, pending files, what tables hold already;
* :mod:`.cycle` - the commit cycle: StartCommit wait, table commits, broadcasts, store.
"""
