"""The worker process shared by prefill and decode: process start-up, heartbeat, metrics, proto <-> engine."""
