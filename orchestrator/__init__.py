"""Orchestrator: the job spec, and one package per role: sdk (in the training process), control (the
controller), agent (on every node), planning, cli, k8s (the operator).

Imports ``providers``, ``health`` and ``optimizer``; none of them imports this package. Which role may
import which is written down and checked in tests/test_layering.py.
"""
