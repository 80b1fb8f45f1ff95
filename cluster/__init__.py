"""Cluster-wide state: the prefix index, KV-event ingestion, traces and the trace simulator."""
