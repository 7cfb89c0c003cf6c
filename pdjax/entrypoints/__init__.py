"""Process launch (DESIGN.md §1 "Layers": the top layer). What starts servers lives here, so
that ``transfer/`` stays below the engine it plugs into: ``pd_roles`` runs the prefill and
decode servers and the one-machine ``--role pd`` demo for ``python -m pdjax.serve``."""
