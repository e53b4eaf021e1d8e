"""``python -m constrained_spec.cli``: the same as the ``constrained-spec`` script."""

from . import main

main()
