"""Health monitoring: telemetry, detectors and recovery policy.

Never imports ``orchestrator``; the orchestrator calls in.
"""
