"""``python -m lightning_oomb ...``: the ``oomb`` console script."""

from lightning_oomb.cli import main

main()
