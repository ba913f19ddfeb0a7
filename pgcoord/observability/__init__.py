"""Metrics (structured log records always, Prometheus when installed) and
OpenTelemetry spans and instruments."""
