"""Data parallelism: process-group helpers and FSDP2 wrapping (DESIGN.md §2 invariant 7, §4)."""
