"""`pagoda route`: a cache-aware router over replicas (docs/router.md). Imports no engine and no torch."""
