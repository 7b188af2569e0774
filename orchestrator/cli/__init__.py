"""The `tfsn` command (typer): launch, plan, status, logs, the controller, the operator and the optimizer."""
