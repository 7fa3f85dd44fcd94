"""memguard's benchmarks: ``python -m benchmarks`` (``--quick`` for a short run)."""
