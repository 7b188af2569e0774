"""Orchestrator: job spec, controller state machine, store, node agent, SDK and CLI.

Imports ``providers``, ``health`` and ``optimizer``; none of them imports this package.
"""
