"""Local HTTP emulators of the cloud REST APIs that tfsn's drivers call.

Each emulator is a real HTTP(S) server on 127.0.0.1 with state (what was created, what was
deleted) and a way for a test to inject an error into the next matching request. A driver under
test reaches it through its SDK's own endpoint setting, so the SDK's real transport, retries,
pollers and error parsing all run. The object stores of checkpoints (blob.py for az://, gcs.py for
gs://) keep state but take no injected errors: the checkpoint tests corrupt objects directly.
"""
