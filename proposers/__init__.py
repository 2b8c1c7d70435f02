"""Built-in proposer plugins for `orchestrate explore` (entry-point group orchestrate.proposers)."""
