"""Rumik OSS 1: a Cohere2 codec LM emitting 8 Mimi tokens per 80 ms frame.

The family plugin is `family.RumikFamily` (entry point `orchestrate.families: rumik`); its
techniques live in `orchestrate.techniques.rumik`. `orchestrate explain STACK` shows which
function fills each slot.
"""
