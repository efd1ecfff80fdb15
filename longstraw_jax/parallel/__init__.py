"""Mesh primitives: the ("data", "seq") mesh, FSDP partition rules, the zigzag sequence layout and rounds, sequence
collectives (ring attention, GDN affine fold, log-sum-exp merge), groups over `data`, expert parallelism. Knows no
model family and no engine (docs/architecture.md 5)."""
