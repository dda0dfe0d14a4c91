"""``python -m icefloe``: the same CLI as the ``icefloe`` script."""

from icefloe.cli.main import main

main()
