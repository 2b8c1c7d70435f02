"""Rumik OSS 1: a Cohere2 codec LM emitting 8 Mimi tokens per 80 ms frame."""

from orchestrator.families.rumik.family import RumikFamily

FAMILY = RumikFamily()
