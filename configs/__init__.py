"""Shipped data files (hardware specs, catalogs, health policy, manifests)."""
