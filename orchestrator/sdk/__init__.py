"""What runs inside the training process: `tfsn.init()` and its Run, checkpoints, the controller client.

Nothing here imports the controller, the agent, the CLI or a cloud driver (tests/test_layering.py).
"""
