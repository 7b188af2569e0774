"""Front ends: a framework's captured training step lowered to the optimizer's IR (optimizer/ir.py)."""
