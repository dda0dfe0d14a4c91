"""``python -m icefloe``: the same CLI as the ``icefloe`` script."""

from icefloe.cli import main

main()
