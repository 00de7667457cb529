"""Anomaly detection: rules, origin location, JSONL records and alerts."""
