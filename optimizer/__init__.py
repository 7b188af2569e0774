"""Kernel optimizer: whole-step capture, search and code generation.

Never imports ``orchestrator``; the orchestrator calls in.
"""
