"""Built-in plugins: draft-head GEMM backends and verifiers."""
