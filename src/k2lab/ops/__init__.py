"""Pure-PyTorch kernels with one dispatch point each (fast path where the runtime has it)."""
