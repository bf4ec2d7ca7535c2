"""The core layer: errors, units, atomic file I/O, hardware descriptions, profiles (and the ones shipped
with the package), plans, pack and program memory, the shared task/tensor enums. Everything else
builds on it; it imports no other harmony_opt layer (except memory.py, which replays a compiled
program: see its imports).
"""
