"""Generated cases: random small PyTorch programs run with remat and checked against the same
program without checkpointing (``python -m remat_fx.fuzz --cases 1000``; docs/fuzz.md).

One module, one job: ``program`` draws and renders programs, ``oracle`` runs one case and
compares, ``shrink`` reduces a failing case, ``__main__`` is the command line. Nothing here is
imported by ``import remat_fx``.
"""
