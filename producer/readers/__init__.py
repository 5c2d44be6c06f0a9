"""Reading prompt sources: `index` (random access to records), `scan` (the build pass)."""
