"""The controller: job store, API server, daemon, and the state machine split by concern
(provisioning, recovery, health watch, API handlers)."""
