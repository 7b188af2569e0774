"""Compute providers: one interface, one module per provider.

Never imports ``orchestrator``: the orchestrator hands a provider plain data (what to run on the
node), and a provider hands back typed records.
"""
