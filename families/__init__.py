"""Model families: each one a plugin package (entry-point group `orchestrate.families`)."""
