"""Providers by name, imported only when a job asks for one (each cloud's SDK is an optional extra)."""
from __future__ import annotations

import importlib

from providers.base import Provider, ProviderError

# name -> (module, class). The module imports its SDK lazily, so importing it is cheap; a missing SDK
# surfaces as MissingExtraError when the provider is first used.
DRIVERS: dict[str, tuple[str, str]] = {
    "local": ("providers.local", "LocalProvider"),
    "aws": ("providers.aws", "AwsProvider"),
    "gcp": ("providers.gcp", "GcpProvider"),
    "azure": ("providers.azure", "AzureProvider"),
    "kubernetes": ("providers.kubernetes", "KubernetesProvider"),
    "skypilot": ("providers.skypilot", "SkyPilotProvider"),
}


def load_provider(name: str) -> Provider:
    """A new provider object for `name`; ProviderError names the fix when it cannot be made."""
    if name not in DRIVERS:
        raise ProviderError(f"no provider named {name!r}. To fix: use one of {', '.join(DRIVERS)}",
                            provider=name, scope="provider")
    module, cls = DRIVERS[name]
    return getattr(importlib.import_module(module), cls)()
