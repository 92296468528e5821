"""Built-in plugins: draft-head GEMM backends, verifiers, targets (the embedded Gemma and the tiny test models) and stacks."""
