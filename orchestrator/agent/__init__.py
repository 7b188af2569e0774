"""The node agent: started on every node (`python -m orchestrator.agent`), it runs setup and the
workers under torchrun as the controller says, and ships logs, results and GPU samples back.
It never imports a cloud driver (tests/test_layering.py)."""
