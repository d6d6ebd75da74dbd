"""Outrider: lossless speculative decoding served over gRPC and Ray Serve.

Packages, lowest first (an import never goes upward; docs/architecture.md, "Layout"):
`proto` (the wire contract), `kernels` (verification), `target_worker`, `draft_worker`,
`demo` (the trained-here model family), `cluster` (Ray Serve app, CLI), `benchmarks`.
"""
