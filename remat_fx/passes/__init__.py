"""Compiler mode: FX passes on AOTAutograd's joint graph (see the compiler issue)."""
