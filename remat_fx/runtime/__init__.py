"""Eager mode: the named tape (see remat_fx/__init__.py for the public names)."""
